"""Training with the ``dtr`` key is bit-identical to training without it.

Every workload config trains 3 small iterations three times through
``MMDTRRunner``: without DTR; for 2 iterations under DTR at a huge
threshold, to measure the baseline peak with the engine's own meter; and
under DTR at 40% of that peak. Parameters and buffers must be equal bit for
bit, with evictions and recomputations reported through the MessageHub and
the log. The combinations with the other keys are in
test_dtr_combinations.py; the two-process run is in
test_dtr_model_wrapper.py.

Torch runs single-threaded here: on a shared 2-core box, OpenMP's two
threads spin against other processes and make every run many times slower.
"""
import gc
import glob
import itertools
import json
import os.path as osp
import uuid

import pytest
import torch
from mmengine.config import Config

from mmdtr.adapters.dtr_train_step import SCALARS, model_device
from mmdtr.adapters.runner import MMDTRRunner

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIGS = osp.join(REPO, 'configs')
SMALL = {
    'train_cfg.max_iters': 3,
    'train_dataloader.batch_size': 2,
    'default_hooks.logger.interval': 1,
}
SMALL_DATA = {
    'SyntheticImageDataset': {
        'train_dataloader.dataset.image_size': 64,
        'train_dataloader.dataset.num_samples': 16,
    },
    'SyntheticTokenDataset': {
        'model.num_layers': 2,
        'model.embed_dims': 128,
        'model.vocab_size': 1024,
        'model.max_seq_len': 64,
        'train_dataloader.dataset.vocab_size': 1024,
        'train_dataloader.dataset.seq_len': 64,
        'train_dataloader.dataset.num_samples': 16,
    },
}
# every workload at 40% of its baseline peak; the other settings vary
WORKLOADS = {
    'resnet50_synthetic': dict(enable_sqrt_sampling=True),
    'shufflenetv2_synthetic': dict(),
    'spos_synthetic': dict(policy='dtr_local'),
    'gpt_synthetic': dict(policy='lru'),
}
MIN_SIZE = 16 * 1024  # the workloads are small: let 16 KiB storages go


@pytest.fixture(autouse=True, scope='module')
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def workload_cfg(name, work_dir, **options):
    cfg = Config.fromfile(osp.join(CONFIGS, f'{name}.py'))
    cfg.merge_from_dict(SMALL)
    cfg.merge_from_dict(SMALL_DATA[cfg.train_dataloader.dataset.type])
    cfg.merge_from_dict(options)
    cfg.work_dir = str(work_dir)
    cfg.experiment_name = f'{name}_{uuid.uuid4().hex[:8]}'
    return cfg


def train(cfg):
    runner = MMDTRRunner.from_cfg(cfg)
    runner.train()
    return runner


def dtr_history(runner):
    """MessageHub name -> the values of every iteration."""
    hub = runner.message_hub
    return {name: list(hub.get_scalar(name).data[0]) for name in SCALARS}


def cpu_state(model):
    """Parameters and buffers by name, copied to CPU."""
    return {
        name: t.detach().cpu().clone()
        for name, t in itertools.chain(model.named_parameters(),
                                       model.named_buffers())
    }


def assert_same_state(model_a, model_b):
    """Parameters and buffers equal, bit for bit; ``model_a`` may be a
    :func:`cpu_state`."""
    state_a = model_a if isinstance(model_a, dict) else cpu_state(model_a)
    state_b = cpu_state(model_b)
    assert state_a.keys() == state_b.keys()
    for name, value in state_a.items():
        assert torch.equal(value, state_b[name]), f'{name} differs'


def cuda_allocated_mb():
    """MiB allocated on CUDA after a garbage collection, or 0 without CUDA.
    On a GPU machine the Runner trains on CUDA, where the engine's meter is
    ``memory_allocated``: it counts what earlier runs of the test left
    there too (and cuBLAS's workspace, made by the first run's matmuls)."""
    if not torch.cuda.is_available():
        return 0.0
    gc.collect()  # a finished run's cycles, or they go during the next
    return torch.cuda.memory_allocated() / 2**20


@pytest.mark.parametrize('name', sorted(WORKLOADS))
def test_workload_bit_identical_under_dtr(name, tmp_path):
    plain = train(workload_cfg(name, tmp_path / 'plain'))
    assert 'train/dtr_evictions' not in plain.message_hub.log_scalars
    plain_state = cpu_state(plain.model)
    on_cuda = model_device(plain.model).type == 'cuda'
    del plain
    leftover_mb = cuda_allocated_mb()
    # two iterations: from the second on, the optimizer's state is there
    probe = train(
        workload_cfg(
            name,
            tmp_path / 'probe',
            dtr=dict(eviction_threshold=2**60, evictee_minimum_size=MIN_SIZE),
            **{'train_cfg.max_iters': 2}))
    probe_stats = dtr_history(probe)
    # on CUDA the meter counts all the device holds: what a run holds
    # between iterations (parameters, optimizer state) is not the step's
    held_mb = cuda_allocated_mb()
    del probe
    assert probe_stats['train/dtr_evictions'] == [0, 0]
    step_mb = probe_stats['train/dtr_peak_memory_mb'][-1] - held_mb
    threshold = int(
        (cuda_allocated_mb() + held_mb - leftover_mb + 0.4 * step_mb) * 2**20)

    runner = train(
        workload_cfg(
            name,
            tmp_path / 'dtr',
            dtr=dict(
                eviction_threshold=threshold,
                evictee_minimum_size=MIN_SIZE,
                **WORKLOADS[name])))
    assert_same_state(plain_state, runner.model)
    stats = dtr_history(runner)
    assert all(len(values) == 3 for values in stats.values())
    # on CUDA the first iteration holds no optimizer state yet, so it may
    # stay under a threshold set for the others: it is checked on CPU only
    # (an H100 run: 1, 0, 0 evictions for GPT when its threshold was set
    # from the first iteration, whose AdamW state was not there yet)
    checked = slice(1 if on_cuda else 0, None)
    assert min(stats['train/dtr_evictions'][checked]) > 0
    assert min(stats['train/dtr_recomputations'][checked]) > 0
    assert stats['train/dtr_remat_seconds'][-1] > 0
    # the peak went down under DTR (not to 40%: the gradients are counted
    # and cannot be evicted). Not on CUDA, whose meter counts the
    # parameters too: in these small runs they and their gradients make
    # most of the peak (ResNet-50: 2 x 98 MiB of its 210 MiB), which did
    # not go down on an H100
    if not on_cuda:
        assert stats['train/dtr_peak_memory_mb'][-1] < step_mb
    (log, ) = glob.glob(osp.join(runner.log_dir, '*.log'))
    with open(log) as f:
        text = f.read()
    assert 'Enabling the "dtr" feature (mmdtr)' in text
    last = [line for line in text.splitlines() if 'Iter(train) [3/3]' in line]
    assert len(last) == 1
    for key in ('dtr_peak_memory_mb: ', 'dtr_evictions: ',
                'dtr_recomputations: ', 'dtr_remat_seconds: '):
        assert key in last[0], last[0]
    assert f"dtr_evictions: {stats['train/dtr_evictions'][-1]}" in last[0]
    (scalars, ) = glob.glob(
        osp.join(runner.log_dir, 'vis_data', 'scalars.json'))
    with open(scalars) as f:
        records = [json.loads(line) for line in f]
    assert [r['dtr_evictions'] for r in records] == \
        stats['train/dtr_evictions']


# --- combinations, on a toy model -----------------------------------------
