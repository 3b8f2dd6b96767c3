"""The ``dtr`` key, its translator and DTRHook, on a toy model."""
import os.path as osp

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import HOOKS, METRICS, MODELS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS

from mmdtr.adapters.dtr_hook import DTRHook, expandable_segments_hint
from mmdtr.adapters.dtr_train_step import model_device
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.core.allocation_failures import ALLOC_CONF_VARS
from mmdtr.core.torch_compat import outer_saved_tensor_hooks
from mmdtr.dtr import DTR, engine_active
from mmdtr.errors import MmdtrError

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
        self.dtr_seen.setdefault(mode, []).append(engine_active())
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
    assert outer_saved_tensor_hooks() is None
    assert not engine_active()


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


@HOOKS.register_module(force=True)
class WrapsTrainStepHook(Hook):
    """A timing hook: wraps ``train_step`` in ``before_train`` and puts the
    saved one back in ``after_train``, called after DTRHook's."""

    priority = 'LOW'

    def before_train(self, runner):
        self.saved = saved = runner.model.train_step
        runner.model.train_step = lambda *a, **k: saved(*a, **k)

    def after_train(self, runner):
        runner.model.train_step = self.saved


def test_a_train_step_wrapped_after_dtr_is_left_inert(tmp_path, make_cfg):
    # the other hook put DTR's wrapper back after DTRHook detached it, and
    # a second runner without DTR trained the model under the first one's
    # engine, publishing into its MessageHub (found by an adversarial
    # search)
    first = MMDTRRunner.from_cfg(
        make_cfg(
            tmp_path / 'first',
            dtr=DTR_CFG,
            custom_hooks=[dict(type='WrapsTrainStepHook')]))
    first.train()
    model = first.model
    assert model.dtr_seen['loss'] == [True] * 3
    published = first.message_hub.get_scalar('train/dtr_evictions').data
    published = len(published[0])
    second = MMDTRRunner.from_cfg(make_cfg(tmp_path / 'second'))
    second.model = model  # the same model trained again, without DTR
    second.train()
    assert model.dtr_seen['loss'][3:] == [False] * 3
    assert len(first.message_hub.get_scalar(
        'train/dtr_evictions').data[0]) == published
    assert_thread_clean()


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
            "'enable_sqrt_sampling': False, 'policy': 'dtr', "
            "'recording_threshold': 'auto'}, in "
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


@pytest.mark.parametrize('device, environ, hinted', [
    ('cpu', {}, False),
    (None, {}, False),
    ('cuda', {}, True),
    (torch.device('cuda', 1), {}, True),
    ('cuda', dict(PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'), False),
    ('cuda',
     dict(PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:128, '
          'expandable_segments: True'), False),
    ('cuda', dict(PYTORCH_ALLOC_CONF='expandable_segments:True'), False),
    ('cuda', dict(PYTORCH_CUDA_ALLOC_CONF='expandable_segments:False'), True),
])
def test_cuda_training_is_told_of_expandable_segments(device, environ, hinted):
    # the default allocator's fragmentation ended ResNet-50's largest batch
    # under DTR at 456 on an H100 and below 432 on an H200, 596 with
    # expandable segments (docs/dtr.md)
    hint = expandable_segments_hint(device, environ)
    assert (hint is not None) == hinted
    if hinted:
        assert 'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True' in hint


def test_the_hint_is_logged_when_training_starts(tmp_path, make_cfg,
                                                 monkeypatch):
    seen = []

    def hint(device):
        seen.append(device)
        return 'mmdtr: a hint for the test'

    monkeypatch.setattr('mmdtr.adapters.dtr_hook.expandable_segments_hint',
                        hint)
    runner = MMDTRRunner.from_cfg(
        make_cfg(tmp_path, dtr=DTR_CFG, log_level='INFO'))
    runner.train()
    with open(osp.join(runner.log_dir, f'{runner.timestamp}.log')) as f:
        assert f.read().count('mmdtr: a hint for the test') == 1
    # the Runner's device: CUDA on a GPU machine
    assert seen == [next(runner.model.parameters()).device]


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('conf, hinted', [(None, True),
                                          ('expandable_segments:True', False)])
def test_training_on_cuda_logs_the_hint_unless_segments_expand(
        tmp_path, make_cfg, monkeypatch, conf, hinted):
    for name in ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    if conf is not None:  # read by the hint; the allocator read it before
        monkeypatch.setenv('PYTORCH_CUDA_ALLOC_CONF', conf)
    runner = MMDTRRunner.from_cfg(
        make_cfg(tmp_path, dtr=DTR_CFG, log_level='INFO'))
    runner.train()
    assert next(runner.model.parameters()).is_cuda
    with open(osp.join(runner.log_dir, f'{runner.timestamp}.log')) as f:
        text = f.read()
    assert text.count('fits larger batches with PYTORCH_CUDA_ALLOC_CONF='
                      'expandable_segments:True') == int(hinted)
    evictions = runner.message_hub.get_scalar('train/dtr_evictions').data[0]
    assert sum(evictions) > 0


@pytest.mark.parametrize('threshold', ['1KB', '1TB'])
def test_a_threshold_not_held_is_logged_once(tmp_path, make_cfg, threshold):
    # below what must stay resident the step slows and the only sign was a
    # scalar in the log line (found by a review over frozen backbones)
    runner = MMDTRRunner.from_cfg(
        make_cfg(
            tmp_path,
            dtr=dict(DTR_CFG, eviction_threshold=threshold),
            log_level='INFO'))
    runner.train()
    failures = runner.message_hub.get_scalar(
        'train/dtr_eviction_failures').data[0]
    with open(osp.join(runner.log_dir, f'{runner.timestamp}.log')) as f:
        text = f.read()
    warned = text.count('was not held in this iteration')
    if threshold == '1KB':
        assert all(n > 0 for n in failures) and len(failures) == 3
        assert warned == 1
        assert 'mmdtr: dtr.eviction_threshold (1.00 KiB)' in text
        # below the floor the peak can pass the run without DTR's (a review
        # over mmdet's Faster R-CNN: 62.3 against 55.9 MiB)
        assert 'or train without DTR if that fits' in text
    else:
        assert not any(failures)
        assert warned == 0


def test_an_array_as_recording_threshold_gets_mmdtrs_error():
    # compared with 'auto' first, it raised NumPy's "truth value of an
    # array ... is ambiguous" (found by an adversarial search)
    import numpy as np

    from mmdtr.adapters.dtr_train_step import dtr_settings
    value = np.array([1, 2])
    with pytest.raises(MmdtrError, match='recording_threshold=array'):
        DTRHook(eviction_threshold='1GB', recording_threshold=value)
    with pytest.raises(MmdtrError, match='recording_threshold=array'):
        dtr_settings(dict(eviction_threshold='1GB', recording_threshold=value))
