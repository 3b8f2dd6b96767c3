"""check_module_names: the module names of a config, checked on its model
before a runner is built."""
import pytest
import torch.nn as nn
from mmengine.config import Config
from mmengine.registry import MODELS

from mmdtr.adapters.activation_checkpointing_hook import \
    ActivationCheckpointingHook
from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.errors import MmdtrError
from mmdtr.utils.module_names import check_module_names, selecting_hooks


@MODELS.register_module(force=True)
class _PopsItsConfig(nn.Module):
    """Takes what it needs out of its nested config, as some heads do."""

    def __init__(self, head):
        super().__init__()
        kind = head.pop('kind')
        self.backbone = nn.Sequential(nn.Linear(4, 4))
        self.head = nn.Linear(4, 2) if kind == 'linear' else None


def _config(model, **keys):
    return translate_memory_keys(Config(dict(model=model, **keys)))


def test_the_model_is_built_from_a_copy():
    # built from the config itself, the runner then built another model
    # (head=None; found by a review)
    model = dict(type='_PopsItsConfig', head=dict(kind='linear'))
    cfg = _config(model, activation_checkpointing=['backbone'])
    check_module_names(cfg)
    assert cfg.model.head == dict(kind='linear')
    with pytest.raises(MmdtrError, match="no sub-module .*'backbon'"):
        check_module_names(
            _config(model, activation_checkpointing=['backbon']))


def test_a_model_given_as_a_module_is_checked():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    check_module_names(_config(model, activation_checkpointing='0'))
    with pytest.raises(MmdtrError, match='no sub-module'):
        check_module_names(_config(model, activation_checkpointing='1'))


@MODELS.register_module(force=True)
class _CountsBuilds(nn.Module):
    builds = 0

    def __init__(self, data_preprocessor):  # given by the config, as the
        # runner gives it
        super().__init__()
        type(self).builds += 1
        self.preprocessor = data_preprocessor
        self.backbone = nn.Linear(4, 4)


def test_the_model_is_built_only_for_selecting_keys():
    before = _CountsBuilds.builds
    check_module_names(
        _config(
            dict(type='_CountsBuilds'), dtr=dict(eviction_threshold='1GB')))
    assert _CountsBuilds.builds == before
    check_module_names(
        _config(
            dict(type='_CountsBuilds'),
            activation_checkpointing='backbone',
            data_preprocessor=dict(type='BaseDataPreprocessor')))
    assert _CountsBuilds.builds == before + 1


# (a type that is not registered is refused by its name when translated)
_UNBUILDABLE = dict(type='_CountsBuilds', no_such_argument=1)


def test_a_model_that_cannot_be_built_is_left_to_the_runner():
    assert 'no_such_argument' in check_module_names(
        _config(_UNBUILDABLE, activation_checkpointing='x'))


def test_a_model_that_cannot_be_built_is_refused_when_strict():
    # --check-config said the names were accepted, unchecked (found by a
    # review)
    with pytest.raises(
            MmdtrError, match='could not be built.*no_such_argument'):
        check_module_names(
            _config(_UNBUILDABLE, activation_checkpointing='x'), strict=True)


@MODELS.register_module(force=True)
class _RefusesItsDepth(nn.Module):

    def __init__(self, depth):
        super().__init__()
        raise MmdtrError(f'depth={depth} is not accepted.', hint='18 or 50.')


def test_an_mmdtr_error_of_the_build_is_raised():
    # it came from the runner's build, after the work dir was made
    with pytest.raises(MmdtrError, match='depth=19'):
        check_module_names(
            _config(
                dict(type='_RefusesItsDepth', depth=19),
                activation_checkpointing='x'))


@pytest.mark.needs_selective_checkpointing
def test_two_checkpointing_hooks_with_other_policies_are_checked_too():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    hooks = [
        dict(type='mmdtr.ActivationCheckpointingHook', modules='0'),
        dict(
            type='mmdtr.ActivationCheckpointingHook',
            modules='*',
            policy='save_matmuls')
    ]
    with pytest.raises(MmdtrError, match="'0' is selected by two"):
        check_module_names(_config(model, custom_hooks=hooks))
    hooks[1]['policy'] = None  # the same policy: harmless
    check_module_names(_config(model, custom_hooks=hooks))


@MODELS.register_module(force=True)
class _ConvBNNet(nn.Module):
    """A Conv-BN pair efficient_conv_bn_eval traces into its parent."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.backbone[1].eval()

    def forward(self, x):
        return self.backbone(x)


def test_a_checkpointed_module_inside_a_fused_trace_is_refused_here():
    # refused in before_train, after efficient_conv_bn_eval had replaced the
    # backbone's forward and tools/train.py had made the work dir (found by
    # a review): both are applied here, to the model built for the check
    cfg = _config(
        dict(type='_ConvBNNet'),
        efficient_conv_bn_eval=['backbone'],
        activation_checkpointing=['backbone.1'])
    with pytest.raises(MmdtrError, match='torch.fx trace'):
        check_module_names(cfg)
    check_module_names(  # apart, each applies
        _config(dict(type='_ConvBNNet'), efficient_conv_bn_eval=['backbone']))
    check_module_names(
        _config(
            dict(type='_ConvBNNet'),
            efficient_conv_bn_eval=['backbone'],
            activation_checkpointing=['backbone']))


@MODELS.register_module(force=True)
class _ConvModuleNet(nn.Module):
    """An mmcv ConvModule with a BN, frozen: its own efficient Conv-BN eval
    applies."""

    def __init__(self):
        super().__init__()
        from mmcv.cnn import ConvModule
        self.backbone = nn.Sequential(
            ConvModule(3, 4, 3, norm_cfg=dict(type='BN')))
        self.backbone[0].bn.eval()


def test_the_conv_of_a_fused_conv_module_is_refused_here():
    # docs said --check-config missed it until training started
    cfg = _config(
        dict(type='_ConvModuleNet'),
        efficient_conv_bn_eval=['backbone'],
        activation_checkpointing=['backbone.0.conv'])
    with pytest.raises(MmdtrError, match="'backbone.0.conv' is the conv"):
        check_module_names(cfg)
    check_module_names(
        _config(
            dict(type='_ConvModuleNet'),
            efficient_conv_bn_eval=['backbone'],
            activation_checkpointing=['backbone.0']))


def test_a_hook_object_is_translated_and_its_names_checked():
    # a config built in Python may hold hook objects, as MMEngine allows:
    # the translation raised a TypeError on one of mmdtr's, and its names
    # went unchecked (found by a review)
    model = nn.Sequential(nn.Linear(4, 4))
    cfg = _config(
        model, custom_hooks=[ActivationCheckpointingHook(modules='0')])
    assert check_module_names(cfg) is None
    assert len(selecting_hooks(cfg)) == 1
    with pytest.raises(MmdtrError, match="no sub-module .*'9'"):
        check_module_names(
            _config(
                model,
                custom_hooks=[ActivationCheckpointingHook(modules='9')]))
