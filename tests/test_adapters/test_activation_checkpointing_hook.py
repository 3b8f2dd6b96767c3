"""The activation_checkpointing key and ActivationCheckpointingHook."""
import glob
import os.path as osp

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from mmengine.runner import Runner
from torch.utils.data import Dataset

from mmdtr.adapters.activation_checkpointing_hook import (
    ActivationCheckpointingHook, translate_activation_checkpointing)
from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS
from mmdtr.techniques.activation_checkpointing import is_checkpointed


class Stage(nn.Module):
    """Conv-BN-ReLU blocks; the forward takes a keyword-only argument."""

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
class ACHookToyNet(BaseModel):

    def __init__(self):
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.backbone.layer1 = Stage()
        self.backbone.layer2 = Stage()
        self.head = nn.Linear(8, 2)

    def forward(self, inputs, labels=None, mode='tensor'):
        x = self.backbone.stem(inputs)
        x = self.backbone.layer1(x, scale=0.5)
        x = self.backbone.layer2(x, scale=2.0)
        logits = self.head(x.mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, labels))
        return logits


@DATASETS.register_module(force=True)
class ACHookToyImages(Dataset):

    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return dict(inputs=torch.randn(3, 8, 8, generator=g), labels=i % 2)


@pytest.fixture
def make_cfg(toy_runner_cfg):

    def make(work_dir, **kwargs):
        return toy_runner_cfg(
            work_dir,
            'ACHookToyNet',
            'ACHookToyImages',
            'ac',
            default_hooks=dict(checkpoint=None),
            randomness=dict(seed=0),
            log_level='INFO',
            **kwargs)

    return make


@pytest.mark.parametrize('value, modules, policy', [
    ('backbone.layer*', ['backbone.layer*'], None),
    (['backbone.layer1', 'head'], ['backbone.layer1', 'head'], None),
    (dict(modules='backbone'), ['backbone'], None),
    (dict(modules=('a', 'b'),
          policy='save_compute_heavy'), ['a', 'b'], 'save_compute_heavy'),
    (dict(modules=['a'], policy=('mm', 'aten.bmm')), ['a'], ['mm', 'aten.bmm'
                                                             ]),
])
def test_translate_accepted_forms(value, modules, policy):
    cfg = translate_activation_checkpointing(value)
    assert cfg == dict(
        type='mmdtr.ActivationCheckpointingHook',
        modules=modules,
        policy=policy)
    hook = HOOKS.build(cfg)
    assert isinstance(hook, ActivationCheckpointingHook)


@pytest.mark.parametrize('value, text', [
    (3, "activation_checkpointing=3 (int) is not accepted. Accepted: a "
     'module name or glob pattern (str), a list of them, or dict(modules='),
    (True, 'activation_checkpointing=True (bool) is not accepted'),
    ([], 'activation_checkpointing=[] is not accepted: expected a module '
     'name or a non-empty list'),
    (['a', 2], "activation_checkpointing=['a', 2] is not accepted"),
    (dict(policy='save_matmuls'), "the dict form takes the keys 'modules' "
     "(required) and 'policy'"),
    (dict(modules='a', polcy=None), "got ['polcy']"),
    (dict(modules='a', policy='fast'), "policy='fast' is not accepted: "
     'unknown policy name'),
    (dict(modules='a', policy=['matmull']), "Closest aten ops: ['matmul'"),
])
def test_translate_rejects(value, text):
    with pytest.raises(MmdtrError) as info:
        translate_activation_checkpointing(value)
    assert str(info.value).startswith('mmdtr: ')
    assert text in str(info.value)
    assert 'Hint:' in str(info.value)


def test_translation_pops_the_key(make_cfg, tmp_path):
    cfg = make_cfg(tmp_path, activation_checkpointing='backbone.layer1')
    out = translate_memory_keys(cfg)
    assert 'activation_checkpointing' not in out
    assert out.custom_hooks[-1] == dict(
        type='mmdtr.ActivationCheckpointingHook',
        modules=['backbone.layer1'],
        policy=None)
    with pytest.raises(MmdtrError):  # all validated before changing cfg
        translate_memory_keys(make_cfg(tmp_path, activation_checkpointing=1))


def test_runner_trains_with_mmdtr_checkpointing(make_cfg, tmp_path):
    cfg = make_cfg(
        tmp_path,
        activation_checkpointing=dict(
            modules=['backbone.layer*'], policy='save_compute_heavy'))
    runner = Runner.from_cfg(translate_memory_keys(cfg))
    # MMEngine's thin version reads this key; it is gone, so it never runs
    assert 'activation_checkpointing' not in runner.cfg
    runner.train()  # the stages take keyword arguments: MMEngine's fails
    model = runner.model
    assert is_checkpointed(model.backbone.layer1)
    assert is_checkpointed(model.backbone.layer2)
    assert not is_checkpointed(model.backbone.stem)
    (hook, ) = [
        h for h in runner.hooks if isinstance(h, ActivationCheckpointingHook)
    ]
    assert hook.wrapped == ['backbone.layer1', 'backbone.layer2']
    assert int(model.backbone.layer1.blocks[0][1].num_batches_tracked) == 2
    (log, ) = glob.glob(osp.join(runner.log_dir, '*.log'))
    with open(log) as f:
        text = f.read()
    assert ('Enabling the "activation_checkpointing" feature (mmdtr, '
            "non-reentrant, policy='save_compute_heavy') for 2 sub-modules: "
            "['backbone.layer1', 'backbone.layer2']") in text


def test_untranslated_key_gets_mmengine_thin_version(make_cfg, tmp_path):
    """Control: MMEngine's own version breaks on keyword arguments."""
    cfg = make_cfg(tmp_path, activation_checkpointing=['backbone.layer1'])
    runner = Runner.from_cfg(cfg)
    with pytest.raises(TypeError, match='unexpected keyword argument'):
        runner.train()
    assert not is_checkpointed(runner.model.backbone.layer1)


def test_runner_unknown_module_fails_before_wrapping(make_cfg, tmp_path):
    cfg = make_cfg(
        tmp_path,
        activation_checkpointing=['backbone.layer1', 'backbone.layr2'])
    runner = Runner.from_cfg(translate_memory_keys(cfg))
    with pytest.raises(MmdtrError) as info:
        runner.train()
    assert "'backbone.layr2'" in str(info.value)
    assert "closest matches: ['backbone.layer2'" in str(info.value)
    assert not is_checkpointed(runner.model.backbone.layer1)
