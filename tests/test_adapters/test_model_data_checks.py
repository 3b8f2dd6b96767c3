"""The model checked against its data, and DDP's switches, when the config
is read: each failed after the work dir was made (at the first iteration,
or in every rank inside PyTorch's ``Reducer``)."""
import os.path as osp

import pytest
from mmengine.config import Config

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.errors import MmdtrError
from mmdtr.models.resnet import ResNetClassifier

CONFIGS = osp.join(osp.dirname(__file__), '..', '..', 'configs')


def _cfg(name, **options):
    cfg = Config.fromfile(osp.join(CONFIGS, name))
    cfg.merge_from_dict(options)
    return cfg


@pytest.mark.parametrize(
    'name, options, match',
    [
        ('resnet50_synthetic.py', {
            'model.num_classes': 10
        }, r'model.num_classes=10 is smaller than '
         r'train_dataloader.dataset.num_classes=1000.*labels'),
        ('resnet50_synthetic.py', {
            'train_dataloader.dataset.num_channels': 1
        }, r'model.in_channels=3 differs from '
         r'train_dataloader.dataset.num_channels=1'),
        ('gpt_synthetic.py', {
            'model.vocab_size': 100
        }, r'model.vocab_size=100 is smaller than .*dataset.vocab_size=8192'),
        ('gpt_synthetic.py', {
            'model.max_seq_len': 64
        }, r'model.max_seq_len=64 is smaller than .*dataset.seq_len=128'),
        ('spos_synthetic.py', {
            'model.type': 'mmdtr.SPOSSupernet',
            'model.num_classes': 3
        }, 'num_classes=3'),
        ('resnet50_synthetic.py', {
            'find_unused_parameters': 'yes'
        }, r"find_unused_parameters='yes' is not accepted: True or False"),
        ('resnet50_synthetic.py', {
            'model_wrapper_cfg':
            dict(type='MMDistributedDataParallel', broadcast_buffers='yes')
        }, r"model_wrapper_cfg.broadcast_buffers='yes' is not accepted"),
        ('resnet50_synthetic.py', {
            'model_wrapper_cfg':
            dict(type='MMDistributedDataParallel', bucket_cap_mb='25')
        }, r"model_wrapper_cfg.bucket_cap_mb='25' is not accepted"),
        (
            'resnet50_synthetic.py',
            {  # an int beyond any float: OverflowError
                'model_wrapper_cfg':
                dict(type='MMDistributedDataParallel', bucket_cap_mb=10**400)
            },
            r'model_wrapper_cfg.bucket_cap_mb=10+ is not accepted'),
        ('resnet50_synthetic.py', {
            'train_dataloader.dataset.type': 'Nope'
        }, r"train_dataloader.dataset.type='Nope' is not registered"),
        ('gpt_synthetic.py', {
            'train_dataloader.dataset.type': 'SyntheticTokenDatset'
        }, r"closest match: 'SyntheticTokenDataset'"),
        # a synthetic dataset's own arguments, before the work dir
        ('resnet50_synthetic.py', {
            'train_dataloader.dataset.num_clases': 10
        }, r"train_dataloader.dataset.num_clases=10 is not accepted: not an "
         r"argument of SyntheticImageDataset.*closest match: 'num_classes'"),
        ('gpt_synthetic.py', {
            'train_dataloader.dataset.seq_len': 0
        }, r'train_dataloader.dataset: seq_len must be a positive int'),
    ])
def test_sizes_and_switches_that_cannot_work_are_refused(name, options, match):
    with pytest.raises(MmdtrError, match=match):
        translate_memory_keys(_cfg(name, **options))


FITTING = [
    ('resnet50_synthetic.py', {}),
    ('resnet50_synthetic.py', {
        'model.num_classes': 2000
    }),  # more: fine
    ('gpt_synthetic.py', {
        'model.vocab_size': 9000
    }),
    # another scope's model of the same name is its own
    ('resnet50_synthetic.py', {
        'model.type': 'mmpretrain.ResNetClassifier',
        'model.num_classes': 10
    }),
    ('resnet50_synthetic.py', {
        'find_unused_parameters': True
    }),
    # what DDP's Reducer takes: ints and None too (found by a review)
    ('resnet50_synthetic.py', {
        'find_unused_parameters': 1
    }),
    ('resnet50_synthetic.py', {
        'find_unused_parameters':
        None,
        'model_wrapper_cfg':
        dict(type='MMDistributedDataParallel', broadcast_buffers=0)
    }),
    # DDP runs with these (found by a fact-check of the first version)
    ('resnet50_synthetic.py', {
        'model_wrapper_cfg':
        dict(
            type='MMDistributedDataParallel',
            bucket_cap_mb=0,
            detect_anomalous_params='yes')
    }),
    # another scope's wrapper may take its own values
    ('resnet50_synthetic.py', {
        'model_wrapper_cfg':
        dict(type='mmfoo.MyWrapper', broadcast_buffers='x')
    }),
    # a test dataloader is built by runner.test() only
    ('resnet50_synthetic.py', {
        'test_dataloader':
        dict(dataset=dict(type='SyntheticImageDataset', num_classes=5000))
    }),
    # another preprocessor may change the channels
    ('resnet50_synthetic.py', {
        'train_dataloader.dataset.num_channels': 1,
        'model.data_preprocessor': dict(type='mmfoo.GrayToRGB')
    }),
    # MMEngine's wrappers, and another scope's names, are left alone
    ('resnet50_synthetic.py', {
        'train_dataloader.dataset.type': 'RepeatDataset',
        'train_dataloader.dataset.times': 2,
        'train_dataloader.dataset.dataset': dict(type='SyntheticImageDataset')
    }),
    ('resnet50_synthetic.py', {
        'train_dataloader.dataset.type': 'mmpretrain.ImageNet'
    }),
]


@pytest.mark.parametrize('name, options', FITTING)
def test_what_fits_or_is_not_mmdtrs_passes(name, options):
    translate_memory_keys(_cfg(name, **options))


def test_a_model_given_as_a_class_is_checked_with_its_defaults():
    cfg = _cfg('resnet50_synthetic.py')
    cfg.model = dict(type=ResNetClassifier, depth=18)  # num_classes 1000
    cfg.train_dataloader.dataset.num_classes = 1001
    with pytest.raises(MmdtrError, match='model.num_classes=1000 is smaller'):
        translate_memory_keys(cfg)
