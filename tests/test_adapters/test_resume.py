"""Resume and load_from under torch.load(weights_only=True), bit for bit."""
import os.path as osp
import shutil
import uuid

import pytest
import torch
from mmengine.logging import HistoryBuffer
from mmengine.runner import Runner

from mmdtr.adapters.checkpoint_loading import (WEIGHTS_ONLY_BY_DEFAULT,
                                               checkpoint_safe_globals,
                                               history_buffer_getattr)
from mmdtr.adapters.runner import MMDTRRunner
from mmdtr.errors import MmdtrError

N_ITERS, CKPT_ITER = 6, 3


def make_cfg(work_dir, **kwargs):
    cfg = dict(
        model=dict(type='ToyClassifier'),
        work_dir=str(work_dir),
        experiment_name=f'resume_{uuid.uuid4().hex}',
        train_dataloader=dict(
            dataset=dict(type='ToyClassDataset'),
            sampler=dict(type='DefaultSampler', shuffle=True),
            batch_size=4,
            num_workers=0,
            collate_fn=dict(type='default_collate')),
        train_cfg=dict(by_epoch=False, max_iters=N_ITERS),
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
        param_scheduler=dict(
            type='MultiStepLR', by_epoch=False, milestones=[2, 5]),
        default_hooks=dict(
            checkpoint=dict(
                type='CheckpointHook', interval=CKPT_ITER, by_epoch=False)),
        randomness=dict(seed=0),
        log_level='WARNING')
    cfg.update(kwargs)
    return cfg


def flat_state(runner):
    """Model state dict and flattened optimizer state of a runner."""
    state = {f'model.{k}': v for k, v in runner.model.state_dict().items()}
    optim = runner.optim_wrapper.state_dict()
    for idx, param_state in optim['state'].items():
        for key, value in param_state.items():
            state[f'optim.{idx}.{key}'] = torch.as_tensor(value)
    for group in optim['param_groups']:
        state['optim.lr'] = torch.as_tensor(group['lr'])
    return state


def assert_bit_equal(a, b):
    # on a GPU machine the Runner trains on CUDA and torch.load loads to CPU
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].cpu(), b[key].cpu()), key


@pytest.fixture(scope='module')
def full_run(tmp_path_factory):
    """An uninterrupted run that saves a checkpoint at CKPT_ITER."""
    work_dir = tmp_path_factory.mktemp('full')
    runner = MMDTRRunner.from_cfg(make_cfg(work_dir))
    runner.train()
    ckpt = osp.join(work_dir, f'iter_{CKPT_ITER}.pth')
    assert osp.isfile(ckpt)
    return flat_state(runner), ckpt


@pytest.mark.needs_weights_only_default
def test_checkpoint_needs_no_other_globals(full_run):
    _, ckpt = full_run
    assert torch.serialization.get_unsafe_globals_in_checkpoint(ckpt) == []
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint['meta']['iter'] == CKPT_ITER
    buffers = checkpoint['message_hub']['log_scalars']
    assert isinstance(buffers['train/loss'], HistoryBuffer)
    assert buffers['train/loss'].mean() > 0


@pytest.mark.parametrize('runner_cls', [MMDTRRunner, Runner])
def test_resume_from_path_is_bit_exact(full_run, tmp_path, runner_cls):
    # the plain Runner works too: importing mmdtr registered the globals
    expected, ckpt = full_run
    cfg = make_cfg(tmp_path, load_from=ckpt, resume=True)
    runner = runner_cls.from_cfg(cfg)
    runner.train()
    assert runner.iter == N_ITERS
    assert_bit_equal(flat_state(runner), expected)


def test_auto_resume_is_bit_exact(full_run, tmp_path):
    expected, ckpt = full_run
    shutil.copy(ckpt, tmp_path)
    (tmp_path /
     'last_checkpoint').write_text(str(tmp_path / osp.basename(ckpt)))
    runner = MMDTRRunner.from_cfg(make_cfg(tmp_path, resume=True))
    runner.train()
    assert_bit_equal(flat_state(runner), expected)


@pytest.mark.needs_weights_only_default
def test_load_from_loads_weights_only(full_run, tmp_path):
    _, ckpt = full_run
    runner = MMDTRRunner.from_cfg(make_cfg(tmp_path, load_from=ckpt))
    runner.load_or_resume()
    saved = torch.load(ckpt, weights_only=True)['state_dict']
    assert_bit_equal(runner.model.state_dict(), saved)
    assert runner.iter == 0  # weights only: no training state


def test_nothing_is_registered_before_weights_only_loads(monkeypatch):
    # PyTorch 2.4's allowlist takes no (object, name) entries: registered
    # there, every weights_only load of the process failed
    from mmdtr.adapters import checkpoint_loading
    calls = []
    monkeypatch.setattr(torch.serialization, 'add_safe_globals', calls.append)
    monkeypatch.setattr(checkpoint_loading, 'WEIGHTS_ONLY_BY_DEFAULT', False)
    checkpoint_loading.register_checkpoint_safe_globals()
    assert calls == []
    monkeypatch.setattr(checkpoint_loading, 'WEIGHTS_ONLY_BY_DEFAULT', True)
    checkpoint_loading.register_checkpoint_safe_globals()
    assert calls == [checkpoint_safe_globals()]


@pytest.mark.needs_weights_only_default
def test_getattr_stand_in_is_restricted(tmp_path):
    path = str(tmp_path / 'x.pth')
    torch.save(dict(f=HistoryBuffer.mean), path)
    assert torch.load(path, weights_only=True)['f'] is HistoryBuffer.mean
    # any other attribute, e.g. a route to __globals__, is refused
    torch.save(dict(f=HistoryBuffer.__init__), path)
    with pytest.raises(MmdtrError, match='refusing getattr'):
        torch.load(path, weights_only=True)
    with pytest.raises(MmdtrError):
        history_buffer_getattr(torch, 'load')
    names = [g[1] for g in checkpoint_safe_globals() if isinstance(g, tuple)]
    assert 'builtins.getattr' in names
    assert getattr not in checkpoint_safe_globals()


def test_dtr_scalars_are_not_carried_into_a_run_without_dtr(tmp_path):
    # they were saved in the message hub: a run resumed without DTR logged
    # the last checkpoint's figures at every iteration (found by an
    # adversarial search)
    dtr = dict(eviction_threshold=1, evictee_minimum_size=0)
    first = MMDTRRunner.from_cfg(make_cfg(tmp_path / 'dtr', dtr=dtr))
    first.train()
    assert first.message_hub.get_scalar('train/dtr_evictions').current() > 0
    ckpt = osp.join(tmp_path, 'dtr', f'iter_{CKPT_ITER}.pth')
    saved = torch.load(
        ckpt,
        weights_only=WEIGHTS_ONLY_BY_DEFAULT)['message_hub']['log_scalars']
    assert not [name for name in saved if 'dtr' in name]
    resumed = MMDTRRunner.from_cfg(
        make_cfg(tmp_path / 'plain', load_from=ckpt, resume=True))
    resumed.train()
    scalars = resumed.message_hub.log_scalars
    assert 'train/loss' in scalars
    assert not [name for name in scalars if 'dtr' in name]
