"""Where mmdtr's keys may sit: one level too deep (train_cfg, model,
env_cfg), a model's own argument, a top-level variable, default_hooks; an
optim_wrapper without an optimizer; another train loop's own arguments.
All refused, or left alone, when the config is translated."""
import re

import pytest
import torch
import torch.nn as nn
from mmengine.config import Config

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.errors import MmdtrError
from . import test_config_translation

make_cfg = test_config_translation.make_cfg  # the fixture, shared


@pytest.mark.parametrize(
    'section,key,value,place',
    [
        ('train_cfg', 'accumulative_counts', 2,
         'optim_wrapper.accumulative_counts'),
        ('train_cfg', 'dtr', dict(eviction_threshold='1GB'),
         'the top-level dtr key'),
        ('train_cfg', 'activation_checkpointing', 'fc',
         'the top-level activation_checkpointing key'),
        ('model', 'dtr', dict(eviction_threshold='1GB'),
         'the top-level dtr key'),
        ('model', 'eviction_threshold', '1GB', 'dtr.eviction_threshold'),
        # found by another adversarial search: a raw TypeError after the work
        # dir (recording_threshold, and the other keys where the model's class
        # takes no such argument), or ignored (env_cfg)
        ('model', 'recording_threshold', '1KB', 'dtr.recording_threshold'),
        ('train_cfg', 'recording_threshold', '1KB', 'dtr.recording_threshold'),
        ('model', 'activation_checkpointing', 'fc',
         'the top-level activation_checkpointing key'),
        ('model', 'accumulative_counts', 2,
         'optim_wrapper.accumulative_counts'),
        ('env_cfg', 'dtr', dict(eviction_threshold='1GB'),
         'the top-level dtr key'),
        ('env_cfg', 'accumulative_counts', 2,
         'optim_wrapper.accumulative_counts'),
    ])
def test_keys_one_level_too_deep_are_refused(section, key, value, place,
                                             make_cfg, tmp_path):
    # MMEngine passed them to the train loop's or the model's constructor:
    # a raw TypeError after the work dir was made, and --check-config
    # accepted them (found by an adversarial search)
    work_dir = tmp_path / 'work'
    cfg = make_cfg(work_dir)
    cfg[section] = dict(cfg.get(section, None) or {}, **{key: value})
    match = re.escape(f'{section}.{key}=') + '.*' + re.escape(
        f'only as {place};')
    with pytest.raises(MmdtrError, match=match):
        MMDTRRunner.from_cfg(cfg)
    assert not work_dir.exists()


def test_a_model_may_take_a_memory_key_as_its_own_argument(make_cfg, tmp_path):
    # model.activation_checkpointing reaches the model: refused only where
    # its class takes no such argument (DTR's own keys always)
    class TakesCheckpointing(nn.Module):

        def __init__(self, activation_checkpointing=None):
            super().__init__()

    class TakesAnything(nn.Module):

        def __init__(self, **kwargs):
            super().__init__()

    for model_type in (TakesCheckpointing, TakesAnything):
        cfg = make_cfg(tmp_path)
        cfg.model = dict(type=model_type, activation_checkpointing='fc')
        translate_memory_keys(cfg)
    cfg.model = dict(type=TakesAnything, recording_threshold='1KB')
    with pytest.raises(MmdtrError, match='model.recording_threshold='):
        translate_memory_keys(cfg)
    cfg.model = dict(type=TakesCheckpointing, accumulative_counts=2)
    with pytest.raises(MmdtrError, match='model.accumulative_counts='):
        translate_memory_keys(cfg)


def test_a_top_level_clip_grad_variable_is_left_alone(make_cfg, tmp_path):
    # a common name for a variable that a model or hook may read (a
    # review); only --cfg-options refuses it at the top level
    translate_memory_keys(make_cfg(tmp_path, clip_grad=dict(max_norm=1.0)))


def test_a_memory_hook_in_default_hooks_is_refused(make_cfg, tmp_path):
    # MMEngine builds any hook there, but the checks read custom_hooks and
    # the keys: a bad value failed after the work dir, and the hook next to
    # its key made a second engine (found by an adversarial search)
    work_dir = tmp_path / 'work'
    cfg = make_cfg(work_dir, default_hooks={})
    cfg.default_hooks['ac'] = dict(
        type='ActivationCheckpointingHook', modules='blokcs.0')
    with pytest.raises(MmdtrError) as info:
        MMDTRRunner.from_cfg(cfg)
    assert info.value.message.startswith(
        "default_hooks.ac={'type': 'ActivationCheckpointingHook'")
    assert 'use the activation_checkpointing key' in info.value.hint
    assert not work_dir.exists()
    cfg.default_hooks['ac'] = dict(type='mmdtr.DTRHook', eviction_threshold=1)
    with pytest.raises(MmdtrError, match='use the dtr key'):
        translate_memory_keys(cfg)
    for other in (dict(type='mmdet.DTRHook'),
                  dict(type='DTRHook', _scope_='mmdet')):  # not mmdtr's
        cfg.default_hooks['ac'] = other
        translate_memory_keys(cfg)
    cfg.default_hooks['ac'] = dict(type='DTRHook')
    cfg.default_scope = 'mmdet'  # looked up in mmdet's registry
    translate_memory_keys(cfg)


@pytest.mark.parametrize('optim_wrapper', [
    dict(type='mmdtr.InplaceOptimWrapper', step_in_backward=True),
    dict(type='OptimWrapper', accumulative_counts=2),
    dict(accumulative_counts=2),
    dict(constructor='DefaultOptimWrapperConstructor', type='OptimWrapper'),
])
def test_an_optim_wrapper_without_optimizer_is_refused(optim_wrapper, make_cfg,
                                                       tmp_path):
    # MMEngine read a dict without an optimizer (nor a constructor) as
    # wrappers already built, and failed in train() with "each item mush be
    # an optimizer object" (found by an adversarial search)
    work_dir = tmp_path / 'work'
    cfg = make_cfg(work_dir)
    cfg.optim_wrapper = optim_wrapper
    with pytest.raises(MmdtrError, match='has no optimizer: MMEngine'):
        MMDTRRunner.from_cfg(cfg)
    assert not work_dir.exists()


def test_an_optim_wrapper_of_built_wrappers_or_a_constructor_passes(
        make_cfg, tmp_path):
    from mmengine.optim import OptimWrapper
    cfg = make_cfg(tmp_path)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    cfg.optim_wrapper = dict(a=OptimWrapper(optimizer))
    translate_memory_keys(cfg)
    cfg.optim_wrapper = dict(
        constructor='MyConstructor', a=dict(optimizer=dict(type='SGD')))
    translate_memory_keys(cfg)


def test_another_train_loop_may_take_accumulation(make_cfg, tmp_path):
    cfg = make_cfg(tmp_path, train_cfg=dict(type='MyLoop', max_iters=2))
    cfg.train_cfg.accumulative_counts = 2  # its own argument, maybe
    translate_memory_keys(cfg)
    cfg.train_cfg.dtr = dict(eviction_threshold='1GB')  # never its own
    with pytest.raises(MmdtrError, match='train_cfg.dtr='):
        translate_memory_keys(cfg)


def test_a_train_loop_given_as_a_class_is_mmengines(tmp_path):
    # a new-style config's type is the class: it read as another loop, and
    # train_cfg.accumulative_counts failed after the work dir was made
    # (found by a review)
    path = tmp_path / 'new_style.py'
    path.write_text('from mmengine.runner import IterBasedTrainLoop\n'
                    'train_cfg = dict(type=IterBasedTrainLoop, max_iters=1,'
                    ' accumulative_counts=2)\n')
    with pytest.raises(MmdtrError, match='train_cfg.accumulative_counts='):
        translate_memory_keys(Config.fromfile(str(path)))
