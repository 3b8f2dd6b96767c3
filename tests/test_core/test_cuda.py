"""The engine's CUDA paths: the ``memory_allocated`` meter, eviction when an
allocation fails (no threshold), and CPU code on a machine with a GPU.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_core/test_cuda.py``. The zoo's CUDA
bit-exactness runs in test_equivalence.py.
"""
import copy

import pytest
import torch
import torch.nn as nn

from mmdtr.core.allocation_failures import allocator_settings
from mmdtr.core.cuda_meter import CudaAllocatedBytes
from mmdtr.core.engine import EngineState
from mmdtr.core.policies import build_policy
from mmdtr.dtr import DTR

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason='needs CUDA')
CUDA = torch.device('cuda', 0)


def _model():
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 32, 3, padding=1)]
    for _ in range(8):
        layers += [
            nn.Conv2d(32, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Dropout(0.1)
        ]
    return nn.Sequential(*layers).to(CUDA)


def _inputs():
    torch.manual_seed(1)
    return torch.randn(16, 3, 64, 64, device=CUDA)


def _step(model, x, **dtr):
    """One step; returns (loss, grads, buffers, stats, allocator peak)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(CUDA)
    torch.manual_seed(2)  # dropout: the CUDA generator
    if dtr:
        with DTR(evictee_minimum_size=1, **dtr) as engine:
            loss = model(x).square().mean()
            loss.backward()
        stats = engine.stats
    else:
        loss = model(x).square().mean()
        loss.backward()
        stats = None
    torch.cuda.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    return (loss.detach(), grads, buffers, stats,
            torch.cuda.max_memory_allocated(CUDA), torch.cuda.get_rng_state())


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert all(torch.equal(g, h) for g, h in zip(a[1], b[1]))
    assert all(torch.equal(g, h) for g, h in zip(a[2], b[2]))
    assert torch.equal(a[5], b[5])  # the CUDA RNG stream did not shift


@pytest.fixture
def memory_fraction():
    """Sets ``torch.cuda.set_per_process_memory_fraction``; restores 1."""
    yield lambda f: torch.cuda.set_per_process_memory_fraction(f, CUDA)
    torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
    torch.cuda.empty_cache()


def test_meter_is_memory_allocated_and_peak_stays_bounded(deterministic):
    model, x = _model(), _inputs()
    _step(copy.deepcopy(model), x)  # warm-up: cuDNN and cuBLAS handles
    base = _step(copy.deepcopy(model), x)
    free = _step(copy.deepcopy(model), x, eviction_threshold=2**40)
    assert free[3].evictions == 0
    # the allocator's own peak, which rose in scope (R11)
    assert 0 < free[3].peak_memory <= free[4]
    _assert_same(base, free)
    static = torch.cuda.memory_allocated()
    threshold = static + (free[4] - static) // 2
    low = _step(copy.deepcopy(model), x, eviction_threshold=threshold)
    assert low[3].evictions > 0 and low[3].recomputations > 0
    _assert_same(base, low)
    # a few activations of 8 MiB (16x32x64x64 fp32): the largest op's
    assert low[4] <= threshold + 5 * 2**23, (low[4], threshold)
    assert low[4] < base[4]


@torch.backends.cudnn.flags(enabled=False)
def test_eviction_on_allocation_failure_without_threshold(
        deterministic, memory_fraction):
    # Without cuDNN: its convolutions swallow a workspace allocation
    # failure and fall back to another algorithm, whose last bits differ
    # (seen on an H100 with torch 2.11; docs/dtr.md, "CUDA").
    model, x = _model(), _inputs()
    _step(copy.deepcopy(model), x)  # warm-up
    base = _step(copy.deepcopy(model), x)
    torch.cuda.empty_cache()
    static = torch.cuda.memory_allocated() + 2 * sum(
        p.numel() * 4 for p in model.parameters())
    cap = static + (base[4] - static) * 6 // 10
    total = torch.cuda.get_device_properties(CUDA).total_memory
    memory_fraction(cap / total)
    ran_out = False
    try:  # the cap bites without DTR
        _step(copy.deepcopy(model), x)
    except torch.OutOfMemoryError:
        ran_out = True  # its frames (and tensors) go with the exception
    assert ran_out
    torch.cuda.empty_cache()
    under_cap = _step(copy.deepcopy(model), x, eviction_threshold=None)
    assert under_cap[3].threshold is None
    assert under_cap[3].evictions > 0 and under_cap[3].recomputations > 0
    _assert_same(base, under_cap)


def _adjacent_exps(p, n, check=True):
    """``n`` outputs of ``p.exp()`` in one segment, one after another: the
    allocator splits the free segment a freed buffer of their size left
    (larger than what earlier tests left free: it picks the smallest block
    that fits)."""
    torch.cuda.empty_cache()
    buffer = torch.empty(n * p.numel(), device=CUDA)
    del buffer
    outs = [p.exp() for _ in range(n)]  # exp saves its output
    nbytes = p.numel() * p.element_size()
    offsets = [t.data_ptr() - outs[0].data_ptr() for t in outs]
    assert not check or offsets == [i * nbytes for i in range(n)], offsets
    return outs


def _fragmenting_step(p, cap=None, check=True):
    """Four outputs adjacent, the second and fourth held from Python, then
    two adjacent; a request of two outputs' size under ``cap(room)``."""
    a = _adjacent_exps(p, 4, check)
    b = _adjacent_exps(p, 2, check)
    losses = [t.sum() for t in a + b]  # LRU's order: a0, a2, b0, b1
    held = a[1], a[3]
    del a, b
    if cap is not None:
        cap(torch.cuda.memory_reserved(CUDA) + p.numel() * p.element_size())
    wide = torch.cat([p, p])  # two outputs' size, in one block
    losses.append(wide.sum())
    del wide
    return torch.stack(losses).sum(), held


def test_a_failed_allocation_evicts_a_run_of_adjacent_blocks(
        deterministic, memory_fraction):
    # R15: evicting in LRU's order, a0 and a2 went first, in vain, as each
    # lies between blocks in use; then b0 and b1. The run b0, b1 serves the
    # request. (Expandable segments lay blocks out otherwise.)
    if 'expandable_segments:true' in allocator_settings():
        pytest.skip('expandable segments')
    torch.manual_seed(0)
    p = torch.randn(2**24, device=CUDA, requires_grad=True)  # 64 MiB
    total = torch.cuda.get_device_properties(CUDA).total_memory
    # first: the step without DTR would leave free blocks of the outputs'
    # size, which the allocator picks first (the smallest that fits)
    with DTR(eviction_threshold=None, policy='lru') as engine:
        dtr_loss, held = _fragmenting_step(
            p, cap=lambda room: memory_fraction(room / total))
        forward = engine.stats
        memory_fraction(1.0)
        dtr_loss.backward()
    del held
    grad, p.grad = p.grad, None
    loss, held = _fragmenting_step(p, check=False)  # laid out otherwise
    loss.backward()
    assert forward.evictions == 2, forward  # one by one: 4
    assert engine.stats.recomputations == 2
    assert torch.equal(dtr_loss, loss) and torch.equal(p.grad, grad)


def test_cpu_code_on_a_cuda_machine_is_metered_on_cpu():
    torch.manual_seed(0)
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256)
    with DTR(eviction_threshold='1MB', evictee_minimum_size=1) as engine:
        h = x
        for _ in range(6):
            h = torch.tanh(h @ w)
        h.sum().backward()
    assert engine.stats.evictions > 0


def test_a_cuda_op_where_the_engine_meters_cpu_is_judged_by_its_kernels():
    # CUDA's index_add sums with atomics, in another order on each call: a
    # scope metered on CPU took the CPU kernel's class and recorded a
    # recipe for it (found by a review; R4)
    assert not torch.are_deterministic_algorithms_enabled()
    state = EngineState(1, 1, False, build_policy('dtr'), 'cpu')
    x = torch.randn(64, 8, device=CUDA, requires_grad=True)
    index = torch.randint(0, 4, (64, ), device=CUDA)
    args = (torch.zeros(4, 8, device=CUDA), 0, index, x)
    with state.lock:  # as the dispatch mode calls it (R12)
        out = state.on_op(torch.ops.aten.index_add.default, args, {})
        doubled = state.on_op(torch.ops.aten.mul.Tensor, (x, x), {})
    assert state.device.type == 'cpu'
    records = state.records
    assert records[out.untyped_storage()._cdata].creator is None
    assert records[doubled.untyped_storage()._cdata].creator is not None


def test_the_meter_reads_memory_allocated_without_flattening():
    meter = CudaAllocatedBytes(CUDA)
    x = torch.empty(2**20, device=CUDA)
    assert meter.read() == torch.cuda.memory_allocated(CUDA)
    assert meter.fast  # torch's nested statistics were read
    y = torch.empty(2**21, device=CUDA)
    assert meter.read() == torch.cuda.memory_allocated(CUDA)
    del x, y
    assert meter.read() == torch.cuda.memory_allocated(CUDA)


def test_the_meters_peak_sees_between_its_reads():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(CUDA)
    meter = CudaAllocatedBytes(CUDA)
    meter.read()
    x = torch.empty(2**22, device=CUDA)
    del x  # allocated and freed between two reads
    assert meter.read() == torch.cuda.memory_allocated(CUDA)
    assert meter.peak == torch.cuda.max_memory_allocated(CUDA)
    assert meter.peak >= 2**24


def test_far_below_its_threshold_the_engine_reads_every_few_ops(monkeypatch):
    reads = []
    read = CudaAllocatedBytes.read
    monkeypatch.setattr(CudaAllocatedBytes, 'read',
                        lambda self: reads.append(1) or read(self))
    model, x = _model(), _inputs()
    stats = _step(model, x, eviction_threshold=2**40)[3]
    assert stats.evictions == 0
    assert len(reads) <= stats.ops // 16 + 2, (len(reads), stats.ops)
