"""The ``dtr`` key, its translator and DTRHook, on a toy model."""
import os.path as osp

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import METRICS, MODELS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS

from mmdtr.adapters.config_translation import translate_memory_keys
from mmdtr.adapters.dtr_hook import DTRHook
from mmdtr.adapters.dtr_model_wrapper import dtr_mode_active, model_device
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DTR_CFG = dict(eviction_threshold='96KB', evictee_minimum_size='4KB')

# two OpenMP threads spin against other processes on a shared box
pytestmark = pytest.mark.usefixtures('single_thread')


class _FailInBackward(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError('boom in backward')


@MODELS.register_module(force=True)
class DTRHookToyNet(BaseModel):
    """Conv-BN-ReLU blocks on 16x16 maps; records where DTR was on.

    ``fail_at=(iteration, 'forward' | 'backward')`` raises there.
    """

    def __init__(self, fail_at=None):
        super().__init__()
        self.body = nn.Sequential(*[
            nn.Sequential(
                nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1),
                nn.BatchNorm2d(8), nn.ReLU()) for i in range(4)
        ])
        self.head = nn.Linear(8, 2)
        self.fail_at = fail_at
        self.calls = 0
        self.dtr_seen = {'loss': [], 'predict': []}

    def forward(self, inputs, labels=None, mode='tensor'):
        self.dtr_seen.setdefault(mode, []).append(dtr_mode_active())
        x = self.body(inputs)
        if mode == 'loss':
            self.calls += 1
            if self.fail_at == (self.calls, 'forward'):
                raise RuntimeError('boom in forward')
            if self.fail_at == (self.calls, 'backward'):
                x = _FailInBackward.apply(x)
        logits = self.head(x.mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, labels))
        return logits


@METRICS.register_module(force=True)
class DTRHookToyMetric(BaseMetric):

    def process(self, data_batch, data_samples):
        self.results.append(len(data_samples))

    def compute_metrics(self, results):
        return dict(count=sum(results))


@pytest.fixture
def make_cfg(toy_runner_cfg):
    """``make_cfg(work_dir, **keys)``: DTRHookToyNet for 3 iterations;
    ``keys`` override any key."""

    def make(work_dir, model='DTRHookToyNet', **keys):
        keys = {
            'default_hooks':
            dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1)),
            'randomness':
            dict(seed=0),
            'log_level':
            'WARNING',
            **keys
        }
        return toy_runner_cfg(
            work_dir,
            model,
            dict(type='SeededToyImages', size=16),
            'dtr_hook',
            max_iters=3,
            **keys)

    return make


def dtr_hook(runner):
    (hook, ) = [h for h in runner.hooks if isinstance(h, DTRHook)]
    return hook


def assert_thread_clean():
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not dtr_mode_active()


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
    ],
    ids=[
        'hook_bad_value', 'hook_missing', 'hook_typo', 'two_hooks', 'compile',
        'key_and_wrapper', 'wrapper_alone', 'upper_case', 'suffix',
        'checkpoint_typo', 'conv_bn_typo', 'hooks_a_dict', 'hooks_a_string',
        'hook_a_string', 'hook_without_type', 'hook_type_typo',
        'hook_type_near_ours', 'hook_type_empty', 'hook_type_relative',
        'hook_priority_name', 'hook_priority_range', 'wrapper_bad_size',
        'wrapper_sub_key_typo', 'wrapper_not_a_dict', 'wrapper_without_dtr',
        'wrapper_without_type'
    ])
def test_combinations_that_cannot_work_fail_at_translation(
        keys, match, make_cfg, tmp_path):
    cfg = make_cfg(tmp_path, **keys)
    with pytest.raises(MmdtrError, match=match) as info:
        MMDTRRunner.from_cfg(cfg)
    assert 'Hint:' in str(info.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


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


@pytest.mark.parametrize('runner_type', [None, 'MMDTRRunner'])
def test_training_under_dtr(tmp_path, runner_type, make_cfg):
    plain = MMDTRRunner.from_cfg(make_cfg(tmp_path / 'plain'))
    plain.train()
    cfg = make_cfg(tmp_path / 'dtr', dtr=DTR_CFG)
    if runner_type:  # what a downstream tools/train.py does
        cfg.runner_type = runner_type
        runner = MMENGINE_RUNNERS.build(cfg)
    else:
        runner = MMDTRRunner.from_cfg(cfg)
    model = runner.model
    runner.train()
    assert_thread_clean()
    assert model.dtr_seen['loss'] == [True] * 3
    assert 'train_step' not in vars(model)  # detached after training
    hook = dtr_hook(runner)
    assert hook.stats.evictions > 0 and hook.stats.recomputations > 0
    hub = runner.message_hub
    evictions = hub.get_scalar('train/dtr_evictions').data[0]
    assert list(evictions) == [hook.stats.evictions] * 3
    peak = hub.get_scalar('train/dtr_peak_memory_mb').current()
    assert peak == hook.stats.peak_memory / 2**20
    for name, p in plain.model.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name]), name


def test_validation_does_not_run_under_dtr(tmp_path, make_cfg):
    cfg = make_cfg(
        tmp_path,
        dtr=DTR_CFG,
        train_cfg=dict(by_epoch=False, max_iters=4, val_interval=2),
        val_dataloader=dict(
            dataset=dict(type='SeededToyImages', size=16),
            sampler=dict(type='DefaultSampler', shuffle=False),
            batch_size=4,
            num_workers=0,
            collate_fn=dict(type='default_collate')),
        val_cfg=dict(type='ValLoop'),
        val_evaluator=dict(type='DTRHookToyMetric'))
    runner = MMDTRRunner.from_cfg(cfg)
    runner.train()
    seen = runner.model.dtr_seen
    assert seen['loss'] == [True] * 4
    assert seen['predict'] == [False] * 4  # 2 validations of 2 batches
    runner.val()  # a standalone validation neither
    assert seen['predict'][4:] == [False] * 2


@pytest.mark.parametrize('where', ['forward', 'backward'])
def test_exception_in_iteration_leaves_nothing(tmp_path, where, make_cfg):
    runner = MMDTRRunner.from_cfg(
        make_cfg(
            tmp_path,
            dtr=DTR_CFG,
            model=dict(type='DTRHookToyNet', fail_at=(2, where))))
    with pytest.raises(RuntimeError, match=f'boom in {where}'):
        runner.train()
    assert_thread_clean()
    # MMEngine calls no hook then: the engine stayed attached, and another
    # runner given the model trained under it (with a DTRHook of its own,
    # it nested a second engine and crashed)
    assert 'train_step' not in vars(runner.model)
    assert 'run' not in vars(runner.train_loop)
    assert 'backward' not in vars(runner.optim_wrapper)
    assert dtr_hook(runner).stats.evictions > 0  # the first iteration's
    # the thread trains without DTR again
    x = torch.randn(
        2, 3, 16, 16, device=model_device(runner.model), requires_grad=True)
    with DTR(eviction_threshold='1GB') as engine:
        runner.model.body(x).sum().backward()
    assert engine.stats.ops > 0
    assert_thread_clean()
    # training again attaches once, not on top of the first attachment
    runner.model.fail_at = None
    runner.train_loop._max_iters = runner.iter + 1
    seen = runner.model.dtr_seen['loss']
    before = len(seen)
    runner.train()
    assert runner.iter == 2 and seen[before:] == [True]
    assert 'train_step' not in vars(runner.model)


def test_one_engine_per_thread(tmp_path, make_cfg):
    runner = MMDTRRunner.from_cfg(make_cfg(tmp_path, dtr=DTR_CFG))
    with pytest.raises(MmdtrError, match='already active on this thread'):
        with DTR(eviction_threshold='1GB'):
            runner.train()
    assert_thread_clean()


def test_custom_hooks_route(tmp_path, make_cfg):
    runner = MMDTRRunner.from_cfg(
        make_cfg(
            tmp_path,
            custom_hooks=[dict(type='mmdtr.DTRHook', **DTR_CFG)],
            log_level='INFO'))
    runner.train()
    hook = dtr_hook(runner)
    assert hook.settings == dict(
        DTR_CFG, enable_sqrt_sampling=False, policy='dtr')
    assert hook.stats.evictions > 0
    with open(osp.join(runner.log_dir, f'{runner.timestamp}.log')) as f:
        text = f.read()
    # the Runner moves the model to CUDA where there is one
    device = model_device(runner.model)
    assert (f'Enabling the "dtr" feature (mmdtr) on {device}: '
            "{'eviction_threshold': '96KB', 'evictee_minimum_size': '4KB', "
            "'enable_sqrt_sampling': False, 'policy': 'dtr'}, in "
            'DTRHookToyNet.train_step (by DTRHook)') in text
    assert 'dtr_evictions: ' in text


def test_stock_runner_refuses_dtr_hook_with_compile(tmp_path, make_cfg):
    # MMDTRRunner refuses the pair with the config; MMEngine's own Runner
    # compiled train_step after before_run and failed inside PyTorch on the
    # second iteration (found by an adversarial search)
    from mmengine.runner import Runner
    cfg = make_cfg(
        tmp_path,
        custom_hooks=[dict(type='mmdtr.DTRHook', **DTR_CFG)],
        compile=dict(backend='aot_eager'))
    runner = Runner.from_cfg(cfg)
    with pytest.raises(MmdtrError, match='compile=.*cannot be combined'):
        runner.train()
    assert 'train_step' not in vars(runner.model)
    assert_thread_clean()
