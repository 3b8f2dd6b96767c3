"""The ``dtr`` key with the other keys (activation checkpointing, efficient
Conv-BN eval, gradient accumulation, ``--resume``) on a toy model: bit for
bit as training without DTR.

Torch runs single-threaded here: on a shared 2-core box, OpenMP's two
threads spin against other processes and make every run many times slower.
"""
import json

import pytest
import torch
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from mmdtr.adapters.checkpoint_loading import WEIGHTS_ONLY_BY_DEFAULT
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.dtr import engine_active
from mmdtr.techniques.activation_checkpointing import is_checkpointed
from .test_dtr_training import assert_same_state, dtr_history, train

pytestmark = pytest.mark.usefixtures('single_thread')


@HOOKS.register_module(force=True)
class DTRComboProbeHook(Hook):
    """Counts optimizer steps; checks DTR is off at each step and after."""

    def before_train(self, runner):
        self.steps, self.active_at_step, self.stack_after = 0, [], []

        def count(*args):
            self.steps += 1
            self.active_at_step.append(engine_active())

        runner.optim_wrapper.optimizer.register_step_pre_hook(count)

    def after_train_iter(self, runner, batch_idx, data_batch, outputs):
        self.stack_after.append(torch._C._len_torch_dispatch_stack())


# 4 samples of 8x16x16 per activation: 32 KiB
COMBO_DTR = dict(eviction_threshold='160KB', evictee_minimum_size='8KB')

COMBO_MODEL = dict(type='ConvToyNet', running_var=1.5)
COMBO_DATA = dict(type='SeededToyImages', length=16, size=16)


@pytest.fixture(scope='module')
def combo_cfg(toy_runner_cfg):
    """``combo_cfg(work_dir, norm_eval=False, accumulate=1,
    inplace_relu=False, **keys)``."""

    def make(work_dir,
             norm_eval=False,
             accumulate=1,
             inplace_relu=False,
             **keys):
        cfg = toy_runner_cfg(
            work_dir,
            dict(COMBO_MODEL, norm_eval=norm_eval, inplace_relu=inplace_relu),
            COMBO_DATA,
            'dtr_combo',
            max_iters=4,
            optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
            custom_hooks=[dict(type='DTRComboProbeHook')],
            default_hooks=dict(checkpoint=None),
            randomness=dict(seed=0),
            log_level='WARNING',
            **keys)
        cfg.optim_wrapper.accumulative_counts = accumulate
        return cfg

    return make


@pytest.fixture(scope='module')
def train_combo(combo_cfg):
    """``train_combo(work_dir, **combo_cfg kwargs)`` -> (runner, probe)."""

    def run(work_dir, **kwargs):
        runner = train(combo_cfg(work_dir, **kwargs))
        (probe, ) = [
            h for h in runner.hooks if isinstance(h, DTRComboProbeHook)
        ]
        assert probe.active_at_step == [False] * probe.steps
        assert probe.stack_after == [0] * 4
        return runner, probe

    return run


@pytest.fixture(scope='module')
def plain_combo(tmp_path_factory, train_combo):
    return train_combo(tmp_path_factory.mktemp('plain'))[0].model


@pytest.mark.parametrize(
    'checkpointing', [
        'backbone.layer1',
        'backbone.*',
        pytest.param(
            dict(modules=['backbone.layer*'], policy='save_compute_heavy'),
            marks=pytest.mark.needs_selective_checkpointing),
    ],
    ids=['some', 'all', 'selective'])
def test_dtr_with_activation_checkpointing(tmp_path, plain_combo,
                                           checkpointing, train_combo):
    runner, _ = train_combo(
        tmp_path, dtr=COMBO_DTR, activation_checkpointing=checkpointing)
    assert is_checkpointed(runner.model.backbone.layer1)
    assert_same_state(plain_combo, runner.model)
    stats = dtr_history(runner)
    assert len(stats['train/dtr_evictions']) == 4
    # what checkpointing leaves saved (module inputs, the head, and with
    # 'backbone.layer1' the stem and layer2) is DTR's to evict
    assert min(stats['train/dtr_evictions']) > 0
    assert min(stats['train/dtr_recomputations']) > 0


def _pack_module(hooks):
    return None if hooks is None else hooks[0].__module__


@pytest.mark.needs_hooks_on_top
def test_checkpoint_hooks_take_precedence_inside(tmp_path, combo_cfg):
    """Inside a checkpointed module autograd uses checkpoint's hooks."""
    seen = {'inside': set(), 'outside': set()}

    def probe(where):

        def hook(module, args):
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            seen[where].add(_pack_module(top))

        return hook

    cfg = combo_cfg(
        tmp_path, dtr=COMBO_DTR, activation_checkpointing='backbone.layer1')
    cfg.train_cfg.max_iters = 1
    runner = MMDTRRunner.from_cfg(cfg)
    model = runner.model
    model.backbone.layer1.blocks[1][0].register_forward_pre_hook(
        probe('inside'))
    model.backbone.layer2.blocks[0][0].register_forward_pre_hook(
        probe('outside'))
    runner.train()
    # DTR's pack (the locked hook over its state)
    assert seen['outside'] == {'mmdtr.core.dtr_mode'}
    # in the forward and in the recompute of the backward
    assert seen['inside'] == {'torch.utils.checkpoint'}


@pytest.mark.parametrize('checkpointing', [
    'backbone.layer2',
    pytest.param(
        dict(modules='backbone.layer2', policy='save_compute_heavy'),
        marks=pytest.mark.needs_selective_checkpointing)
])
def test_dtr_with_efficient_conv_bn_eval(tmp_path, train_combo, checkpointing):
    fused, _ = train_combo(
        tmp_path / 'fused', norm_eval=True, efficient_conv_bn_eval='backbone')
    both, _ = train_combo(
        tmp_path / 'dtr',
        norm_eval=True,
        inplace_relu=True,  # the same values as ReLU()'s
        efficient_conv_bn_eval='backbone',
        activation_checkpointing=checkpointing,
        dtr=COMBO_DTR)
    assert_same_state(fused.model, both.model)
    stats = dtr_history(both)
    assert min(stats['train/dtr_evictions']) > 0
    assert min(stats['train/dtr_recomputations']) > 0


def test_dtr_with_gradient_accumulation(tmp_path, train_combo):
    plain, steps = train_combo(tmp_path / 'plain', accumulate=2)
    assert steps.steps == 2  # 4 iterations, 2 accumulated per step
    runner, probe = train_combo(tmp_path / 'dtr', accumulate=2, dtr=COMBO_DTR)
    assert probe.steps == 2  # closed before them; and after every iteration
    assert_same_state(plain.model, runner.model)
    stats = dtr_history(runner)
    assert len(stats['train/dtr_evictions']) == 4  # stepping or not
    assert min(stats['train/dtr_evictions']) > 0


RESUME_CONFIG = '''
model = dict(type='ConvToyNet', running_var=1.5)
train_dataloader = dict(
    dataset=dict(type='SeededToyImages', length=16, size=16),
    sampler=dict(type='DefaultSampler', shuffle=True),
    batch_size=4,
    num_workers=0,
    collate_fn=dict(type='default_collate'))
train_cfg = dict(by_epoch=False, max_iters=6)
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
param_scheduler = dict(type='MultiStepLR', by_epoch=False, milestones=[4])
default_hooks = dict(
    checkpoint=dict(type='CheckpointHook', interval=3, by_epoch=False))
randomness = dict(seed=0)
log_level = 'WARNING'
'''


def test_dtr_with_resume(tmp_path, train_tool):
    config = tmp_path / 'resume_cfg.py'
    config.write_text(RESUME_CONFIG)
    plain, resumed = tmp_path / 'plain', tmp_path / 'resumed'
    train_tool.main([
        str(config), '--work-dir',
        str(plain), '--cfg-options', 'experiment_name=dtr_resume_plain'
    ])
    train_tool.main([
        str(config), '--work-dir',
        str(resumed), '--resume',
        str(plain / 'iter_3.pth'), '--cfg-options',
        'experiment_name=dtr_resume_dtr', 'dtr.eviction_threshold=160KB',
        'dtr.evictee_minimum_size=8KB', 'default_hooks.logger.type=LoggerHook',
        'default_hooks.logger.interval=1'
    ])
    expected = torch.load(
        str(plain / 'iter_6.pth'), weights_only=WEIGHTS_ONLY_BY_DEFAULT)
    got = torch.load(
        str(resumed / 'iter_6.pth'), weights_only=WEIGHTS_ONLY_BY_DEFAULT)
    assert got['meta']['iter'] == 6
    for key, value in expected['state_dict'].items():
        assert torch.equal(value, got['state_dict'][key]), key
    momenta = [
        s['momentum_buffer'] for s in got['optimizer']['state'].values()
    ]
    for i, state in expected['optimizer']['state'].items():
        assert torch.equal(state['momentum_buffer'], momenta[i]), i
    (scalars, ) = resumed.glob('*/vis_data/scalars.json')
    logged = [json.loads(line) for line in scalars.read_text().splitlines()]
    evictions = [r['dtr_evictions'] for r in logged if 'dtr_evictions' in r]
    assert len(evictions) == 3 and min(evictions) > 0  # iterations 4 to 6


def test_train_step_set_on_the_model_is_kept(tmp_path, toy_runner_cfg):
    # DTRHook wraps train_step for training and deleted it afterwards: a
    # train_step the user had set on the instance was gone
    cfg = toy_runner_cfg(
        tmp_path,
        'LinearToyModel',
        'RangeToyDataset',
        'own_step',
        dtr=dict(eviction_threshold='1B', evictee_minimum_size='1B'))
    runner = MMDTRRunner.from_cfg(cfg)
    model, under_dtr = runner.model, []

    def own_train_step(data, optim_wrapper):
        under_dtr.append(engine_active())
        return type(model).train_step(model, data, optim_wrapper)

    model.train_step = own_train_step
    runner.train()
    assert under_dtr == [True, True]
    assert vars(model)['train_step'] is own_train_step
