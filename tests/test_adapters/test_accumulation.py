"""Gradient accumulation with activation checkpointing and Conv-BN eval.

Each case trains the same toy model for 4 iterations with
``optim_wrapper.accumulative_counts=2`` (2 optimizer steps) through
``translate_memory_keys`` and ``Runner.from_cfg``, and compares the final
parameters and buffers with the run without the feature.
"""
import uuid

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, HOOKS, MODELS
from mmengine.runner import Runner
from torch.utils.data import Dataset

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.techniques.activation_checkpointing import is_checkpointed


class Stage(nn.Module):

    def __init__(self, width=8, depth=2):
        super().__init__()
        self.blocks = nn.Sequential(*[
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width), nn.ReLU()) for _ in range(depth)
        ])

    def forward(self, x, *, scale=1.0):
        return self.blocks(x) * scale


@MODELS.register_module(force=True)
class AccumToyNet(BaseModel):
    """Stem and two stages; ``norm_eval`` freezes every BatchNorm."""

    def __init__(self, norm_eval=False):
        super().__init__()
        self.norm_eval = norm_eval
        self.backbone = nn.Module()
        self.backbone.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.backbone.layer1 = Stage()
        self.backbone.layer2 = Stage()
        self.head = nn.Linear(8, 2)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_var.fill_(1.5)

    def train(self, mode=True):
        super().train(mode)
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, inputs, labels=None, mode='tensor'):
        x = self.backbone.stem(inputs)
        x = self.backbone.layer2(self.backbone.layer1(x, scale=0.5))
        logits = self.head(x.mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, labels))
        return logits


@DATASETS.register_module(force=True)
class AccumToyImages(Dataset):

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return dict(inputs=torch.randn(3, 8, 8, generator=g), labels=i % 2)


@HOOKS.register_module(force=True)
class CountOptimizerSteps(Hook):

    def before_train(self, runner):
        self.steps = 0

        def count(*args):
            self.steps += 1

        runner.optim_wrapper.optimizer.register_step_post_hook(count)


def _train(tmp_path, norm_eval=False, **keys):
    cfg = Config(
        dict(
            model=dict(type='AccumToyNet', norm_eval=norm_eval),
            work_dir=str(tmp_path),
            experiment_name=f'accum_{uuid.uuid4().hex}',
            train_dataloader=dict(
                dataset=dict(type='AccumToyImages'),
                sampler=dict(type='DefaultSampler', shuffle=False),
                batch_size=4,
                num_workers=0,
                collate_fn=dict(type='default_collate')),
            train_cfg=dict(by_epoch=False, max_iters=4),
            optim_wrapper=dict(
                optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
                accumulative_counts=2),
            custom_hooks=[dict(type='CountOptimizerSteps')],
            default_hooks=dict(checkpoint=None),
            randomness=dict(seed=0),
            log_level='WARNING',
            **keys))
    runner = Runner.from_cfg(translate_memory_keys(cfg))
    runner.train()
    (counter, ) = [
        h for h in runner.hooks if isinstance(h, CountOptimizerSteps)
    ]
    assert counter.steps == 2  # 4 iterations, 2 accumulated per step
    return runner.model


def _state(model):
    return dict(model.named_parameters()), dict(model.named_buffers())


@pytest.fixture(scope='module')
def plain(tmp_path_factory):
    return _state(_train(tmp_path_factory.mktemp('plain')))


@pytest.fixture(scope='module')
def plain_frozen(tmp_path_factory):
    return _state(_train(tmp_path_factory.mktemp('frozen'), norm_eval=True))


@pytest.mark.parametrize('value', [
    'backbone.layer*',
    dict(modules=['backbone.*'], policy='save_compute_heavy')
])
def test_checkpointing_bit_identical(tmp_path, plain, value):
    model = _train(tmp_path, activation_checkpointing=value)
    assert is_checkpointed(model.backbone.layer1)
    params, buffers = _state(model)
    for name, p in plain[0].items():
        assert torch.equal(p, params[name]), name
    for name, b in plain[1].items():
        assert torch.equal(b, buffers[name]), name
    assert int(buffers['backbone.layer1.blocks.0.1.num_batches_tracked']) \
        == 4


def test_conv_bn_eval_and_checkpointing(tmp_path, plain_frozen):
    fused = _state(
        _train(
            tmp_path / 'fused',
            norm_eval=True,
            efficient_conv_bn_eval=['backbone']))
    both_model = _train(
        tmp_path / 'both',
        norm_eval=True,
        efficient_conv_bn_eval=['backbone'],
        activation_checkpointing=['backbone.layer*'])
    assert is_checkpointed(both_model.backbone.layer2)
    both = _state(both_model)
    for name, p in plain_frozen[0].items():
        # folding BN into the conv changes rounding only
        assert torch.allclose(p, fused[0][name], rtol=1e-5, atol=1e-6), name
        # checkpointing on top changes nothing at all
        assert torch.equal(fused[0][name], both[0][name]), name
    for name, b in plain_frozen[1].items():
        assert torch.equal(b, fused[1][name]) and torch.equal(
            b, both[1][name]), name
