"""The config keys' translation: what cannot work is refused before the
Runner is built, with nothing made; what can is left as written."""
import os.path as osp

import pytest
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
        # too short to compare, but holding DTR's settings (found by an
        # adversarial search: trained without DTR)
        (dict(dtrr=dict(eviction_threshold='1GB')), "is it the 'dtr' key"),
        (dict(dt=dict(recording_threshold=None)), "is it the 'dtr' key"),
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
        'short_typo', 'shortest_typo', 'checkpoint_typo', 'conv_bn_typo',
        'alias_dtr', 'alias_checkpointing', 'top_level_threshold',
        'top_level_accumulation', 'hooks_a_dict', 'hooks_a_string',
        'hook_a_string', 'hook_without_type', 'hook_type_typo',
        'hook_type_near_ours', 'hook_type_empty', 'hook_type_relative',
        'hook_priority_name', 'hook_priority_range', 'hook_priority_bool',
        'wrapper_bad_size', 'wrapper_sub_key_typo', 'wrapper_not_a_dict',
        'wrapper_without_dtr', 'wrapper_without_type',
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


def test_short_keys_without_dtrs_settings_are_left_alone(make_cfg, tmp_path):
    # dt = dict(...) holding no DTR setting is another project's variable
    translate_memory_keys(make_cfg(tmp_path, dt=dict(lr=0.1), dtrr=1))


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
