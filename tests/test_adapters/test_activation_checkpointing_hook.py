"""The activation_checkpointing key and ActivationCheckpointingHook."""
import glob
import os.path as osp

import pytest
import torch.nn as nn
from mmengine.runner import Runner

from mmdtr.adapters.activation_checkpointing_hook import (
    ActivationCheckpointingHook, translate_activation_checkpointing)
from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS
from mmdtr.techniques.activation_checkpointing import is_checkpointed


@pytest.fixture
def make_cfg(toy_runner_cfg):

    def make(work_dir, **kwargs):
        return toy_runner_cfg(
            work_dir,
            dict(type='ConvToyNet', scales=(0.5, 2.0)),
            'SeededToyImages',
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
    pytest.param(
        dict(modules=('a', 'b'), policy='save_compute_heavy'), ['a', 'b'],
        'save_compute_heavy',
        marks=pytest.mark.needs_selective_checkpointing),
    pytest.param(
        dict(modules=['a'], policy=('mm', 'aten.bmm')), ['a'],
        ['mm', 'aten.bmm'],
        marks=pytest.mark.needs_selective_checkpointing),
])
def test_translate_accepted_forms(value, modules, policy):
    cfg = translate_activation_checkpointing(value)
    assert cfg == dict(
        type='mmdtr.ActivationCheckpointingHook',
        modules=modules,
        policy=policy)
    hook = HOOKS.build(cfg)
    assert isinstance(hook, ActivationCheckpointingHook)


@pytest.mark.parametrize(
    'value, text',
    [
        (3, "activation_checkpointing=3 (int) is not accepted. Accepted: a "
         'module name or glob pattern (str), a list of them, or dict(modules='
         ),
        (True, 'activation_checkpointing=True (bool) is not accepted'),
        ([], 'activation_checkpointing=[] is not accepted: expected a module '
         'name or a non-empty list'),
        (['a', 2], "activation_checkpointing=['a', 2] is not accepted"),
        (dict(policy='save_matmuls'), "the dict form takes the keys 'modules' "
         "(required) and 'policy'"),
        (dict(modules='a', polcy=None), "got the unknown keys ['polcy']"),
        (dict(policy='save_matmuls'), 'got no modules'),
        (dict(modules='a', policy='fast'), "policy='fast' is not accepted: "
         'unknown policy name'),
        (dict(modules='a', policy=['matmull']), "Closest aten ops: ['matmul'"),
        # named the whole key's value as 3 (found by a review)
        (dict(modules=3), 'activation_checkpointing.modules=3 is not accepted'
         ),
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
    bad = make_cfg(tmp_path, activation_checkpointing=1)
    before = bad.to_dict()
    # all validated before changing cfg (an audit: nothing checked it)
    with pytest.raises(MmdtrError, match='activation_checkpointing=1'):
        translate_memory_keys(bad)
    assert bad.to_dict() == before


@pytest.mark.needs_selective_checkpointing
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


def test_stock_runner_refuses_the_hook_next_to_mmengines_key(
        make_cfg, tmp_path):
    # MMEngine's Runner applies its own key after before_run: both would
    # wrap the modules (its reentrant checkpoint around mmdtr's left the
    # backbone without gradients; found by an adversarial search)
    cfg = make_cfg(
        tmp_path,
        activation_checkpointing=['backbone.layer1'],
        custom_hooks=[
            dict(
                type='mmdtr.ActivationCheckpointingHook',
                modules=['backbone.layer1'])
        ])
    runner = Runner.from_cfg(cfg)
    with pytest.raises(MmdtrError, match='configured twice') as info:
        runner.train()
    assert "activation_checkpointing=['backbone.layer1']" in str(info.value)
    assert not is_checkpointed(runner.model.backbone.layer1)


@pytest.mark.parametrize('second, refused', [
    pytest.param(
        'save_compute_heavy',
        True,
        marks=pytest.mark.needs_selective_checkpointing),
    (None, False),
])
def test_one_module_two_hooks_needs_one_policy(make_cfg, tmp_path, second,
                                               refused):
    # the hook applied last set its policy and both were logged as enabled
    # (found by an adversarial search); the same policy twice is harmless
    hooks = [
        dict(type='mmdtr.ActivationCheckpointingHook', modules='backbone.*'),
        dict(
            type='mmdtr.ActivationCheckpointingHook',
            modules='backbone.layer1',
            policy=second),
    ]
    runner = Runner.from_cfg(make_cfg(tmp_path, custom_hooks=hooks))
    if not refused:
        runner.train()
        assert is_checkpointed(runner.model.backbone.layer1)
        return
    with pytest.raises(
            MmdtrError,
            match="'backbone.layer1' is selected by "
            'two ActivationCheckpointingHooks'):
        runner.train()
    assert not is_checkpointed(runner.model.backbone.layer1)
    assert not is_checkpointed(runner.model.backbone.layer2)


@pytest.mark.needs_selective_checkpointing
def test_a_container_counts_as_its_members_for_the_policy_check():
    # one hook selecting 'blocks', an nn.ModuleList, wraps blocks.0, which
    # another hook selected with another policy: the last applied won,
    # unrefused (a review)
    from types import SimpleNamespace

    from mmengine.config import Config
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    mine = ActivationCheckpointingHook('blocks')
    theirs = ActivationCheckpointingHook(
        'blocks.0', policy='save_compute_heavy')
    runner = SimpleNamespace(
        model=model, hooks=[mine, theirs], cfg=Config(dict()))
    for hook in (mine, theirs):
        with pytest.raises(
                MmdtrError,
                match="'blocks.0' is selected by two "
                'ActivationCheckpointingHooks'):
            hook.before_run(runner)
