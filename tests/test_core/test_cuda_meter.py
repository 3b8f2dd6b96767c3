"""The CUDA meter on CPU: its choice of reader and its peak with a stand-in
allocator, and when the engine reads it (R11) with a stand-in meter.

On a GPU, tests/test_core/test_cuda.py checks it against the real one.
"""
import pytest
import torch
import torch.nn as nn

from mmdtr.core.cuda_meter import READ_EVERY_OPS, CudaAllocatedBytes
from mmdtr.dtr import DTR


class FakeAllocator:
    """Stands in for the CUDA allocator's two ways to read its counters."""

    def __init__(self, nested=True, agree=True):
        self.allocated, self.nested, self.agree = 1234, nested, agree
        self.max_allocated = 1234
        self.flattening_reads = 0

    def set(self, allocated, max_allocated=None):
        self.allocated = allocated
        self.max_allocated = max(self.max_allocated, allocated) \
            if max_allocated is None else max_allocated

    def memory_stats(self, index):
        assert index == 3
        if not self.nested:
            return {}  # another layout
        return {
            'allocated_bytes': {
                'all': {
                    'current': self.allocated,
                    'peak': self.max_allocated
                }
            }
        }

    def memory_allocated(self, index=None):
        assert index == 3
        self.flattening_reads += 1
        return self.allocated + (0 if self.agree else 1)

    def max_memory_allocated(self, index=None):
        assert index == 3
        return self.max_allocated


@pytest.fixture
def allocator(monkeypatch, request):
    fake = FakeAllocator(**getattr(request, 'param', {}))
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 3)
    monkeypatch.setattr(
        torch._C, '_cuda_memoryStats', fake.memory_stats, raising=False)
    monkeypatch.setattr(torch.cuda, 'memory_allocated', fake.memory_allocated)
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated',
                        fake.max_memory_allocated)
    return fake


def test_reads_the_nested_counter_after_one_check(allocator):
    meter = CudaAllocatedBytes(torch.device('cuda'))  # no index: current
    assert meter.read() == 1234 and meter.fast and meter.index == 3
    allocator.set(999)
    assert [meter.read() for _ in range(5)] == [999] * 5
    assert allocator.flattening_reads == 1  # the check alone


@pytest.mark.parametrize(
    'allocator', [dict(nested=False), dict(agree=False)], indirect=True)
def test_falls_back_to_memory_allocated(allocator):
    meter = CudaAllocatedBytes(torch.device('cuda', 3))
    meter.read()
    assert meter.fast is False
    allocator.set(999)
    before = allocator.flattening_reads
    assert meter.read() == allocator.memory_allocated(3)
    assert allocator.flattening_reads == before + 2  # each read flattens


def test_falls_back_without_the_nested_statistics(allocator, monkeypatch):
    monkeypatch.delattr(torch._C, '_cuda_memoryStats')
    meter = CudaAllocatedBytes(torch.device('cuda', 3))
    assert meter.read() == 1234 and meter.fast is False


def test_reads_zero_until_cuda_is_initialized(allocator, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: False)
    meter = CudaAllocatedBytes(torch.device('cuda', 3))
    assert meter.read() == 0 and meter.fast is None
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: True)
    assert meter.read() == 1234 and meter.fast


def test_peak_is_the_allocators_once_it_rose_after_the_first_read(allocator):
    allocator.set(100, max_allocated=5000)  # a peak from before the scope
    meter = CudaAllocatedBytes(torch.device('cuda', 3))
    meter.read()
    allocator.set(300)
    meter.read()
    assert meter.peak == 300  # the largest read: 5000 was before
    allocator.set(200, max_allocated=6000)  # rose between two reads
    meter.read()
    assert meter.peak == 6000


def test_peak_after_the_allocators_peak_is_reset(allocator):
    allocator.set(100, max_allocated=5000)
    meter = CudaAllocatedBytes(torch.device('cuda', 3))
    meter.read()
    allocator.set(200, max_allocated=900)  # reset_peak_memory_stats, then
    meter.read()  # 900 was reached after the first read
    assert meter.peak == 900


class CountingMeter:
    """Stands in for the CUDA meter of an engine running CPU ops: reads the
    engine's own count plus ``unseen`` bytes, and logs the clock of each
    read."""

    def __init__(self, state, unseen=0):
        self.state, self.unseen, self.peak, self.clocks = state, unseen, 0, []

    def read(self):
        self.clocks.append(self.state.clock)
        memory = self.state.in_use + self.unseen
        self.peak = max(self.peak, memory)
        return memory


def _metered_as_cuda(engine, unseen=0, guard=None):
    """Make an active engine meter as on CUDA, with a :class:`CountingMeter`.

    Its ops stay CPU ops (and its lists of ops kept on CUDA apply)."""
    state = engine._state
    state.device, state.cuda = torch.device('cpu'), True
    state.start_cuda_meter(CountingMeter(state, unseen))
    if guard is not None:
        state.cuda_guard = guard
    return state.cuda_meter


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    return nn.Sequential(*layers)


def _step(model, engine=None, **metered):
    torch.manual_seed(1)
    x = torch.randn(512, 256)
    meter = _metered_as_cuda(
        engine, guard=2**20, **metered) if engine else None
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], meter


def test_far_below_the_limit_the_counter_is_read_every_few_ops():
    model = _model()
    with DTR(eviction_threshold=2**40, evictee_minimum_size=1) as every:
        _step(model)  # metered on CPU, after every op
    model = _model()
    with DTR(eviction_threshold=2**40, evictee_minimum_size=1) as engine:
        _, _, meter = _step(model, engine)
    ops = engine.stats.ops
    gaps = [b - a for a, b in zip(meter.clocks, meter.clocks[1:])]
    assert max(gaps) <= READ_EVERY_OPS
    # the op loop reads once every READ_EVERY_OPS ops; the stats once more
    assert len(meter.clocks) <= ops // READ_EVERY_OPS + 2
    assert engine.stats.peak_memory == every.stats.peak_memory
    assert meter.peak <= engine.stats.peak_memory


@pytest.mark.parametrize('unseen', [0, 3 * 2**20])
def test_reading_rarely_evicts_as_reading_after_every_op(unseen):
    """Metered as on CUDA with ``unseen`` bytes the engine does not count,
    it makes the decisions of the CPU engine (read after every op) at the
    threshold less ``unseen``: the skipped reads were all below the limit.
    """
    base_loss, base_grads, _ = _step(_model())
    threshold = 4 * 2**20  # the step's peak: about 8 MiB
    model = _model()
    with DTR(eviction_threshold=threshold, evictee_minimum_size=1) as every:
        _step(model)
    model = _model()
    with DTR(
            eviction_threshold=threshold + unseen,
            evictee_minimum_size=1) as engine:
        loss, grads, meter = _step(model, engine, unseen=unseen)
    stats, expected = engine.stats, every.stats
    assert stats.evictions > 0 and stats.eviction_failures == 0
    assert (stats.evictions, stats.recomputations,
            stats.ops) == (expected.evictions, expected.recomputations,
                           expected.ops)
    # reads and the estimates between them (the reads alone miss some)
    assert stats.peak_memory == expected.peak_memory + unseen
    assert meter.peak <= stats.peak_memory
    assert len(meter.clocks) < stats.ops  # yet some ops were not read
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(g, h) for g, h in zip(grads, base_grads))


def test_memory_the_engine_cannot_see_is_read_within_read_every_ops():
    """Bytes the engine's count misses (an allocation outside the
    dispatcher, say) are found at the next periodic read, which evicts."""
    with DTR(eviction_threshold=2**30, evictee_minimum_size=1) as engine:
        state = engine._state
        meter = _metered_as_cuda(engine, guard=2**20)
        torch.manual_seed(1)
        h = _model()(torch.randn(512, 256))
        meter.unseen, clock = 2**30, state.clock
        for _ in range(READ_EVERY_OPS):
            h = torch.tanh(h)
        assert any(clock < c <= clock + READ_EVERY_OPS for c in meter.clocks)
        assert state.evictions > 0  # over the limit once read
