"""The efficient_conv_bn_eval key and EfficientConvBnEvalHook."""
import copy
import glob
import os.path as osp
import uuid
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn import ConvModule
from mmengine.logging import MMLogger
from mmengine.model import BaseModel
from mmengine.registry import MODELS
from mmengine.runner import Runner

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.adapters.conv_bn_eval_hook import (EfficientConvBnEvalHook,
                                              mmcv_conv_module_support,
                                              translate_efficient_conv_bn_eval)
from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS


@MODELS.register_module(force=True)
class ConvBnHookToyNet(BaseModel):
    """Plain Conv+BN pairs and mmcv ConvModules; BN frozen (norm_eval)."""

    def __init__(self, norm_eval=True):
        super().__init__()
        self.norm_eval = norm_eval
        self.backbone = nn.Module()
        self.backbone.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.backbone.layer1 = nn.Sequential(
            ConvModule(8, 8, 3, padding=1, norm_cfg=dict(type='BN')),
            ConvModule(8, 8, 3, padding=1, norm_cfg=dict(type='BN')))
        self.head = nn.Linear(8, 2)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):  # "pretrained" statistics
                m.running_var.fill_(2.0)
                m.running_mean.fill_(0.1)

    def train(self, mode=True):
        super().train(mode)
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, inputs, labels=None, mode='tensor'):
        x = self.backbone.layer1(self.backbone.stem(inputs))
        logits = self.head(x.mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, labels))
        return logits


@pytest.fixture
def make_cfg(toy_runner_cfg):

    def make(work_dir, **kwargs):
        return toy_runner_cfg(
            work_dir,
            'ConvBnHookToyNet',
            'SeededToyImages',
            'cbe',
            default_hooks=dict(checkpoint=None),
            randomness=dict(seed=0),
            log_level='INFO',
            **kwargs)

    return make


@pytest.mark.parametrize('value, modules', [('backbone', ['backbone']),
                                            (('a', 'b.*'), ['a', 'b.*'])])
def test_translate_accepted_forms(value, modules):
    cfg = translate_efficient_conv_bn_eval(value)
    assert cfg == dict(type='mmdtr.EfficientConvBnEvalHook', modules=modules)
    assert isinstance(HOOKS.build(cfg), EfficientConvBnEvalHook)


@pytest.mark.parametrize('value', [1, [], [''], dict(modules='a'), ['a', 1]])
def test_translate_rejects(value):
    with pytest.raises(MmdtrError) as info:
        translate_efficient_conv_bn_eval(value)
    assert str(info.value).startswith(
        f'mmdtr: efficient_conv_bn_eval={value!r} is not accepted: '
        'expected a module name or a non-empty list of module names')


def test_mmcv_conv_module_support():
    bn_module = ConvModule(2, 2, 1, norm_cfg=dict(type='BN'))
    assert mmcv_conv_module_support(bn_module)
    assert bn_module.efficient_conv_bn_eval_forward is not None
    assert not mmcv_conv_module_support(ConvModule(2, 2, 1))  # no norm
    assert not mmcv_conv_module_support(
        ConvModule(2, 2, 1, norm_cfg=dict(type='GN', num_groups=1)))
    assert not mmcv_conv_module_support(
        ConvModule(
            2, 2, 1, norm_cfg=dict(type='BN'), order=('norm', 'conv', 'act')))
    assert not mmcv_conv_module_support(nn.Conv2d(2, 2, 1))
    # mmcv's fused form calls conv._conv_forward: ConvWS2d's own forward
    # (weight standardization) would be skipped
    ws = ConvModule(
        2, 2, 1, conv_cfg=dict(type='ConvWS'), norm_cfg=dict(type='BN'))
    assert not mmcv_conv_module_support(ws)
    assert ws.efficient_conv_bn_eval_forward is None


def test_hook_matches_plain_and_logs(make_cfg, tmp_path, seeded_toy_images):
    cfg = make_cfg(tmp_path, efficient_conv_bn_eval=['backbone', 'head'])
    runner = Runner.from_cfg(translate_memory_keys(cfg))
    assert 'efficient_conv_bn_eval' not in runner.cfg  # not MMEngine's
    plain = copy.deepcopy(runner.model)
    runner.train()
    (hook, ) = [
        h for h in runner.hooks if isinstance(h, EfficientConvBnEvalHook)
    ]
    backbone, head = hook.results
    assert backbone.fused_pairs == 2 and backbone.traced == ['backbone.stem']
    assert backbone.native_modules == 2
    assert not head.enabled
    (log, ) = glob.glob(osp.join(runner.log_dir, '*.log'))
    with open(log) as f:
        text = f.read()
    assert ('Enabling the "efficient_conv_bn_eval" feature for these '
            "modules ['backbone', 'head']") in text
    assert ("efficient_conv_bn_eval: 'backbone': 2 Conv+BN pairs fused in 1 "
            "torch.fx-traced modules ['backbone.stem']; 2 mmcv ConvModules "
            'use their own support.') in text
    assert ("WARNING - efficient_conv_bn_eval: no Conv+BN pair was fused in "
            "module 'head', it runs unchanged. Why: 'head': it is a single "
            'layer (Linear)') in text
    # the same two SGD steps without the feature
    model = runner.model
    plain.train()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    data = seeded_toy_images()
    device = next(plain.parameters()).device  # the Runner's: CUDA if any
    for start in (0, 4):
        batch = [data[i] for i in range(start, start + 4)]
        inputs = torch.stack([b['inputs'] for b in batch]).to(device)
        labels = torch.tensor([b['labels'] for b in batch], device=device)
        optimizer.zero_grad()
        plain(inputs, labels, mode='loss')['loss'].backward()
        optimizer.step()
    for (name, p), (_, q) in zip(plain.named_parameters(),
                                 model.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name
    for (name, p), (_, q) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(p, q), name


def test_unknown_name_raises_on_train(make_cfg, tmp_path):
    cfg = make_cfg(tmp_path, efficient_conv_bn_eval=['backbone.stm'])
    runner = Runner.from_cfg(translate_memory_keys(cfg))
    with pytest.raises(MmdtrError, match=r"closest matches: \['backbone"):
        runner.train()


def test_bad_checkpointing_name_leaves_the_model_unfused(make_cfg, tmp_path):
    # every mmdtr hook checks its names in before_run, before any of them
    # changes the model in before_train
    cfg = make_cfg(
        tmp_path,
        efficient_conv_bn_eval=['backbone'],
        activation_checkpointing=['backbone.layerX'])
    _assert_refused_unchanged(
        Runner.from_cfg(translate_memory_keys(cfg)),
        "matches 'backbone.layerX'")


def _assert_refused_unchanged(runner, match):
    """``runner.train()`` raises ``MmdtrError`` matching ``match``, with
    no module's forward replaced."""
    forwards = {
        name: type(module).forward
        for name, module in runner.model.named_modules()
    }
    with pytest.raises(MmdtrError, match=match):
        runner.train()
    assert forwards == {
        name: type(module).forward
        for name, module in runner.model.named_modules()
    }
    assert not any('forward' in vars(module)
                   for module in runner.model.modules())


def test_applies_once_and_before_val_or_test():
    model = ConvBnHookToyNet().eval()
    runner = SimpleNamespace(
        model=model, logger=MMLogger.get_instance(f'cbe_{uuid.uuid4().hex}'))
    hook = EfficientConvBnEvalHook('backbone.stem')
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    hook.before_val(runner)
    (result, ) = hook.results
    assert result.fused_pairs == 2
    forward = model.backbone.stem.forward
    hook.before_test(runner)
    hook.before_train(runner)
    assert model.backbone.stem.forward == forward  # not traced again
    # nor applied again: refused there as wrapped already, it reported 0
    # pairs fused (found by mutation testing)
    assert hook.results == [result]
    assert torch.allclose(model(x), expected, rtol=1e-4, atol=1e-6)


def test_stock_runner_refuses_the_hook_next_to_mmengines_key(
        make_cfg, tmp_path):
    # MMEngine's Runner applies its own key after before_run: the pairs
    # would be fused twice (found by an adversarial search)
    cfg = make_cfg(
        tmp_path,
        efficient_conv_bn_eval=['backbone'],
        custom_hooks=[
            dict(type='mmdtr.EfficientConvBnEvalHook', modules=['backbone'])
        ])
    _assert_refused_unchanged(Runner.from_cfg(cfg), 'configured twice')


@pytest.mark.parametrize('norm_eval', [True, False])
def test_training_norms_are_logged(make_cfg, tmp_path, norm_eval):
    # the fused form runs in eval mode only: with every norm training, the
    # log said how many pairs were fused and nothing else (a review)
    cfg = make_cfg(tmp_path, efficient_conv_bn_eval=['backbone'])
    cfg.model = dict(type='ConvBnHookToyNet', norm_eval=norm_eval)
    runner = Runner.from_cfg(translate_memory_keys(cfg))
    runner.train()
    (log, ) = glob.glob(osp.join(runner.log_dir, '*.log'))
    with open(log) as f:
        text = f.read()
    warned = text.count("every BatchNorm in 'backbone' is in training mode")
    assert warned == (0 if norm_eval else 1)
