"""The config keys' translation: what cannot work is refused before the
Runner is built, with nothing made; what can is left as written."""
import os.path as osp
import re

import pytest
import torch
import torch.nn as nn
from mmengine.config import Config
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.adapters.dtr_hook import DTRHook
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.errors import MmdtrError

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


@pytest.fixture
def make_cfg(toy_runner_cfg):
    """``make_cfg(work_dir, **keys)``: LinearToyModel's config; ``keys``
    override any key."""

    def make(work_dir, **keys):
        return toy_runner_cfg(work_dir, 'LinearToyModel', 'RangeToyDataset',
                              'config_translation', **keys)

    return make


@pytest.mark.parametrize('hook_type', ['mmdtr.DTRHook', 'DTRHook', DTRHook])
def test_key_and_hook_together_fail_before_training(hook_type, make_cfg,
                                                    tmp_path):
    cfg = make_cfg(
        tmp_path,
        default_scope='mmdtr',  # where 'DTRHook' is found
        dtr=dict(eviction_threshold='1GB'),
        custom_hooks=[dict(type=hook_type, eviction_threshold='2GB')])
    with pytest.raises(
            MmdtrError, match=r'custom_hooks\[0\].*both '
            'configure DTRHook'):
        translate_memory_keys(cfg)


WRAPPER = dict(
    type='mmdtr.DTRDistributedDataParallel',
    dtr=dict(eviction_threshold='1GB'))


@pytest.mark.parametrize(
    'keys, match',
    [
        (dict(custom_hooks=[
            dict(type='mmdtr.DTRHook', eviction_threshold='1XB')
        ]), r"custom_hooks\[0\].*'1XB' is not a size"),
        (dict(custom_hooks=[dict(type='mmdtr.ActivationCheckpointingHook')]),
         r"custom_hooks\[0\].*missing 1 required"),
        (dict(custom_hooks=[dict(type=DTRHook, evicton_threshold='1GB')]),
         r"custom_hooks\[0\].*closest matches: .*'eviction_threshold'"),
        (dict(custom_hooks=[
            dict(type='mmdtr.DTRHook', eviction_threshold='1GB'),
            dict(type=DTRHook, eviction_threshold='2GB')
        ]), r'custom_hooks\[0\] and custom_hooks\[1\] both configure '
         'DTRHook'),
        (dict(
            dtr=dict(eviction_threshold='1GB'),
            compile=dict(backend='aot_eager')), 'compile=.*cannot be '
         'combined'),
        (dict(
            dtr=dict(eviction_threshold='1GB'),
            model_wrapper_cfg=WRAPPER,
            launcher='pytorch'), 'DTR is configured twice'),
        (dict(model_wrapper_cfg=WRAPPER), "launcher='none'.*DTR would be "
         'off'),
        (dict(DTR=dict(eviction_threshold='1GB')), "is it the 'dtr' key"),
        (dict(dtr_cfg=dict(eviction_threshold='1GB')), "is it the 'dtr' key"),
        (dict(activation_checkpoint=['backbone']),
         "is it the 'activation_checkpointing' key"),
        (dict(efficient_conv_bn=['backbone']),
         "is it the 'efficient_conv_bn_eval' key"),
        # other names users try, and settings given at the top level: each
        # trained silently without the feature (found by an adversarial
        # search)
        (dict(use_dtr=True), "is it the 'dtr' key"),
        (dict(activation_ckpt=['backbone']),
         "is it the 'activation_checkpointing' key"),
        (dict(eviction_threshold='40MB'), "eviction_threshold='40MB' is a "
         'top-level key: mmdtr reads it only as dtr.eviction_threshold'),
        (dict(accumulative_counts=4),
         'reads it only as optim_wrapper.accumulative_counts'),
        # the cases below ended in MMEngine's tracebacks at the build (found
        # by an adversarial search): a dict without its brackets was read
        # as the list of its keys
        (dict(
            custom_hooks=dict(type='mmdtr.DTRHook', eviction_threshold='1GB')),
         'custom_hooks=.* is not accepted: MMEngine takes a list'),
        (dict(custom_hooks='DTRHook'), 'takes a list'),
        (dict(custom_hooks=['mmdtr.DTRHook']),
         r'custom_hooks\[0\]=.*a dict with a type'),
        (dict(custom_hooks=[dict(eviction_threshold='1GB')]),
         r'custom_hooks\[0\]=.*a dict with a type'),
        (dict(custom_hooks=[
            dict(type='CheckpointHook', interval=1),
            dict(type='mmdtr.DTRHok', eviction_threshold='1GB')
        ]), r"custom_hooks\[1\]: type='mmdtr.DTRHok' is not a registered"
         r".*closest match: 'DTRHook'"),
        (dict(custom_hooks=[dict(type='DTRHok', eviction_threshold='1GB')]),
         "type='DTRHok' is not a registered"),
        (dict(custom_hooks=[dict(type='')]),
         r"custom_hooks\[0\]: type='' is not accepted"),
        (dict(custom_hooks=[dict(type='.DTRHook')]),
         r"custom_hooks\[0\]: type='.DTRHook' is not accepted"),
        (dict(custom_hooks=[
            dict(
                type='mmdtr.DTRHook',
                eviction_threshold='1GB',
                priority='NOPE')
        ]), r"custom_hooks\[0\]: priority='NOPE' is not accepted"),
        (dict(custom_hooks=[
            dict(type='CheckpointHook', interval=1, priority=-5)
        ]), r'custom_hooks\[0\]: priority=-5 is not accepted'),
        (dict(custom_hooks=[
            dict(type='CheckpointHook', interval=1, priority=True)
        ]), r'custom_hooks\[0\]: priority=True is not accepted'),
        (dict(
            model_wrapper_cfg=dict(WRAPPER, dtr=dict(eviction_threshold='3X')),
            launcher='pytorch'), "'3X' is not a size"),
        (dict(
            model_wrapper_cfg=dict(WRAPPER, dtr=dict(eviction_treshold=1)),
            launcher='pytorch'), 'eviction_treshold'),
        # raw errors in every rank while the runner was built (found by an
        # adversarial search)
        (dict(model_wrapper_cfg='mmdtr.DTRDistributedDataParallel'),
         'model_wrapper_cfg=.* is not accepted: MMEngine takes a dict'),
        (dict(
            model_wrapper_cfg=dict(
                WRAPPER, type='mmdtr.MMDTRDistributedDataParallel'),
            launcher='pytorch'), 'only DTRDistributedDataParallel'),
        (dict(model_wrapper_cfg=dict(dtr=WRAPPER['dtr']),
              launcher='pytorch'), "type=None: only DTRDistributed"),
        # accepted, then plain DDP or a failure in every rank (found by an
        # adversarial search)
        (dict(
            model_wrapper_cfg=dict(type=WRAPPER['type']),
            launcher='pytorch'), 'without DTR settings'),
        (dict(
            model_wrapper_cfg=dict(
                WRAPPER, type='mmdtr.DTRDistributedDataParalel'),
            launcher='pytorch'), "closest match: 'DTRDistributedDataParallel"),
    ],
    ids=[
        'hook_bad_value', 'hook_missing', 'hook_typo', 'two_hooks', 'compile',
        'key_and_wrapper', 'wrapper_alone', 'upper_case', 'suffix',
        'checkpoint_typo', 'conv_bn_typo', 'alias_dtr', 'alias_checkpointing',
        'top_level_threshold', 'top_level_accumulation', 'hooks_a_dict',
        'hooks_a_string', 'hook_a_string', 'hook_without_type',
        'hook_type_typo', 'hook_type_near_ours', 'hook_type_empty',
        'hook_type_relative', 'hook_priority_name', 'hook_priority_range',
        'hook_priority_bool', 'wrapper_bad_size', 'wrapper_sub_key_typo',
        'wrapper_not_a_dict', 'wrapper_without_dtr', 'wrapper_without_type',
        'wrapper_without_settings', 'wrapper_typo'
    ])
def test_combinations_that_cannot_work_fail_at_translation(
        keys, match, make_cfg, tmp_path):
    cfg = make_cfg(tmp_path, **keys)
    with pytest.raises(MmdtrError, match=match) as info:
        MMDTRRunner.from_cfg(cfg)
    assert 'Hint:' in str(info.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_objects_in_the_config_are_checked_too(make_cfg, tmp_path):
    # a hook object skipped the checks for a hook configured twice, and a
    # policy object passed, then failed the config dump in a raw traceback
    # (found by an adversarial search)
    from mmdtr.dtr import POLICIES
    cfg = make_cfg(
        tmp_path,
        dtr=dict(eviction_threshold='1GB'),
        custom_hooks=[DTRHook(eviction_threshold='2GB')])
    with pytest.raises(MmdtrError, match='both configure DTRHook'):
        translate_memory_keys(cfg)
    cfg = make_cfg(
        tmp_path, dtr=dict(eviction_threshold='1GB', policy=POLICIES['lru']()))
    with pytest.raises(MmdtrError, match='register_policy'):
        translate_memory_keys(cfg)


def test_legitimate_configs_are_not_refused(make_cfg, tmp_path):
    # an imported class named like the key (new-style configs import
    # `DETR`), a 4-letter key near 'dtr' (`detr`), two checkpointing hooks
    # (per-module policies), a hook with a registry `_scope_`
    from torch.nn import Identity as DETR
    hooks = [
        dict(type='mmdtr.ActivationCheckpointingHook', modules='a'),
        dict(type='ActivationCheckpointingHook', modules='b', priority=40),
        dict(type='DTRHook', eviction_threshold='1GB', _scope_='mmdtr'),
    ]
    cfg = make_cfg(
        tmp_path,
        default_scope='mmdtr',
        DETR=DETR,
        detr=dict(x=1),
        custom_hooks=hooks)
    assert translate_memory_keys(cfg).custom_hooks == hooks
    # a variable its section reads (one of an OptimWrapperDict's too), also
    # with another value there (--cfg-options on the section's key), or a
    # DTRHook reads; and other projects' names (found by a review: mmdet3d
    # configs set with_cp at the top level and pass it to the backbone)
    sgd = dict(type='SGD', lr=0.1)
    cfg = make_cfg(
        tmp_path,
        eviction_threshold='1GB',
        dtr=dict(eviction_threshold='2GB'),
        accumulative_counts=2,
        optim_wrapper=dict(
            constructor='MultiOptimWrapperConstructor',
            g=dict(optimizer=sgd, accumulative_counts=4),
            d=dict(optimizer=sgd)),
        with_cp=True,
        gradient_checkpointing=False,
        checkpointing=False)
    translate_memory_keys(cfg)
    cfg = make_cfg(
        tmp_path,
        eviction_threshold='1GB',
        custom_hooks=[dict(type='mmdtr.DTRHook', eviction_threshold='1GB')])
    translate_memory_keys(cfg)


@pytest.mark.parametrize('default_scope', [None, 'mmengine', 'mmdet'])
def test_plain_hook_name_outside_mmdtrs_scope_is_refused(
        default_scope, make_cfg, tmp_path):
    # MMEngine looks a plain name up in the default scope's registry and
    # its parents, never in mmdtr's: a KeyError when the runner was built
    # (found by an adversarial search)
    cfg = make_cfg(
        tmp_path,
        default_scope=default_scope,
        custom_hooks=[dict(type='DTRHook', eviction_threshold='1GB')])
    with pytest.raises(
            MmdtrError, match=r"custom_hooks\[0\]: type='DTRHook'") as info:
        translate_memory_keys(cfg)
    assert "type='mmdtr.DTRHook'" in info.value.hint
    for hook in (dict(type='mmdtr.DTRHook'),
                 dict(type='DTRHook', _scope_='mmdtr')):
        cfg.custom_hooks = [dict(hook, eviction_threshold='1GB')]
        translate_memory_keys(cfg)
    cfg.default_scope = 'mmdtr'
    cfg.custom_hooks = [dict(type='DTRHook', eviction_threshold='1GB')]
    translate_memory_keys(cfg)
    cfg.default_scope = default_scope  # MMEngine's own hooks: left alone
    cfg.custom_hooks = [dict(type='EMAHook')]
    translate_memory_keys(cfg)
    cfg.custom_hooks = []  # nor is a DDP wrapper of mmdtr's
    cfg.launcher, cfg.model_wrapper_cfg = 'pytorch', dict(
        type='DTRDistributedDataParallel', dtr=dict(eviction_threshold='1GB'))
    with pytest.raises(MmdtrError, match="model_wrapper_cfg: type='DTRD"):
        translate_memory_keys(cfg)


def test_plain_hook_name_in_a_scope_built_on_mmdtrs_is_accepted(
        make_cfg, tmp_path):
    # a project whose registry is a child of mmdtr's: MMEngine finds
    # mmdtr's names through its parents (a false refusal; found by a review)
    from mmengine.registry import Registry

    from mmdtr.registry import HOOKS as MMDTR_HOOKS
    scope = 'mmdtr_test_child_project'
    if MMDTR_HOOKS._search_child(scope) is None:
        Registry('hook', parent=MMDTR_HOOKS, scope=scope)
    cfg = make_cfg(
        tmp_path,
        default_scope=scope,
        custom_hooks=[dict(type='DTRHook', eviction_threshold='1GB')])
    translate_memory_keys(cfg)


def test_near_miss_check_leaves_used_keys_alone(make_cfg, tmp_path):
    # the key itself is there: a variable named after it is not a typo
    cfg = make_cfg(
        tmp_path, dtr_threshold='1GB', dtr=dict(eviction_threshold='1GB'))
    assert translate_memory_keys(cfg).custom_hooks[-1].type == 'mmdtr.DTRHook'


@pytest.mark.parametrize('key, feature', [
    ('dtr_cfg', dict(custom_hooks=[dict(type='mmdtr.DTRHook')])),
    ('dtr_cfg', dict(model_wrapper_cfg=dict(dtr=dict(eviction_threshold=1)))),
    ('activation_checkpointing_modules',
     dict(custom_hooks=[dict(type='ActivationCheckpointingHook')])),
])
def test_near_miss_check_leaves_variables_of_an_enabled_feature_alone(
        make_cfg, tmp_path, key, feature):
    # dtr_cfg = dict(...) feeding a DTRHook (or the wrapper's dtr, or a
    # hook's modules) was refused as a misspelt 'dtr' key, while a setting
    # at the top level feeding a hook was not (found by a review): with the
    # feature enabled otherwise, nothing trains without it
    from mmdtr.adapters.near_miss_keys import refuse_near_misses
    cfg = make_cfg(tmp_path, **{key: dict(eviction_threshold='1GB')},
                   **feature)
    refuse_near_misses(
        cfg, ['dtr', 'activation_checkpointing', 'efficient_conv_bn_eval'])
    with pytest.raises(MmdtrError, match='is it the'):  # not otherwise on
        refuse_near_misses(
            make_cfg(tmp_path, **{key: dict(eviction_threshold='1GB')}),
            ['dtr', 'activation_checkpointing', 'efficient_conv_bn_eval'])


def test_bad_value_fails_before_training(train_tool, tmp_path, capsys,
                                         make_cfg):
    config = osp.join(REPO, 'configs', 'gpt_synthetic.py')
    with pytest.raises(SystemExit) as info:
        train_tool.main([
            config, '--work-dir',
            str(tmp_path / 'tool'), '--cfg-options',
            'dtr.eviction_threshold=3XB'
        ])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "MmdtrError: mmdtr: dtr={'eviction_threshold': '3XB'}" in err
    assert 'Traceback' not in err
    assert not (tmp_path / 'tool').exists()  # nothing was started
    bad = dict(eviction_threshold='1GB', polcy='lru')
    with pytest.raises(MmdtrError, match=r"closest matches: \['policy'\]"):
        MMDTRRunner.from_cfg(make_cfg(tmp_path / 'runner', dtr=bad))
    with pytest.raises(MmdtrError, match='dtr.polcy'):
        MMENGINE_RUNNERS.build(
            make_cfg(tmp_path / 'type', runner_type='MMDTRRunner', dtr=bad))
    assert not (tmp_path / 'runner').exists()
    assert not (tmp_path / 'type').exists()


def test_absent_or_none_is_off(tmp_path, make_cfg):
    for cfg in (make_cfg(tmp_path), make_cfg(tmp_path, dtr=None)):
        out = translate_memory_keys(cfg)
        assert 'dtr' not in out
        assert not any(h['type'] == 'mmdtr.DTRHook' for h in out.custom_hooks)


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
