"""measure_peak_memory: exact peaks from the profiler's memory events."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmdtr.utils.profiler_memory import (MemoryMeasurement, measure_memory,
                                         measure_peak_memory)

FLOAT = 4  # bytes of a float32


def _pattern():
    a = torch.empty(1000)
    b = torch.empty(2000)
    del a
    c = torch.empty(500)
    return b, c


def test_known_pattern_exact():
    measured = measure_memory(_pattern)
    assert isinstance(measured, MemoryMeasurement)
    assert measured.deltas == [4000, 8000, -4000, 2000]
    assert measured.peak_bytes == 12000
    assert measured.end_bytes == 10000
    assert measured.allocated_bytes == 14000
    assert measured.freed_bytes == 4000
    b, c = measured.result
    assert b.numel() == 2000 and c.numel() == 500


def test_measure_peak_memory_passes_arguments():
    result, peak = measure_peak_memory(torch.zeros, 3, 256, dtype=torch.int64)
    assert result.shape == (3, 256) and result.dtype == torch.int64
    assert peak == 3 * 256 * 8


def test_replacing_a_tensor_holds_two_at_once():

    def loop():
        t = None
        for _ in range(5):
            t = torch.ones(1024)  # the new one exists before the old dies
        return t

    _, peak = measure_peak_memory(loop)
    assert peak == 2 * 1024 * FLOAT


def test_counts_from_zero_at_start():
    keep = [torch.empty(10000)]  # allocated before the call

    def free_then_allocate():
        keep.clear()  # a free of a block the profiler never saw
        return torch.empty(100)

    measured = measure_memory(free_then_allocate)
    assert measured.peak_bytes == 100 * FLOAT
    assert measured.end_bytes == 100 * FLOAT


def test_no_allocation_peak_is_zero():
    x, y = torch.ones(64), torch.ones(64)
    _, peak = measure_peak_memory(x.add_, y)
    assert peak == 0
    assert torch.equal(x, torch.full((64, ), 2.))


def test_autograd_backward_is_counted():
    w = torch.randn(64, 64, requires_grad=True)

    def step():
        (w @ w).relu().sum().backward()

    measured = measure_memory(step)
    # the grad (64 * 64 floats) stays alive after the call
    assert measured.end_bytes == 64 * 64 * FLOAT
    # w @ w, relu's output and the grad are live together at least once
    assert measured.peak_bytes >= 3 * 64 * 64 * FLOAT


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(1, 4096)),
        min_size=1,
        max_size=12))
def test_random_alloc_free_sequences(ops):
    """Allocate or free (the oldest live tensor) in a random order."""
    expected_live = expected_peak = 0

    def run():
        live = []
        for allocate, numel in ops:
            if allocate or not live:
                live.append(torch.empty(numel))
            else:
                live.pop(0)
        return live

    sizes = []
    for allocate, numel in ops:
        if allocate or not sizes:
            sizes.append(numel * FLOAT)
            expected_live += numel * FLOAT
            expected_peak = max(expected_peak, expected_live)
        else:
            expected_live -= sizes.pop(0)
    measured = measure_memory(run)
    assert measured.peak_bytes == expected_peak
    assert measured.end_bytes == expected_live


def test_other_device_type_ignores_cpu_events():
    measured = measure_memory(torch.empty, (100, ), device_type='cuda')
    assert measured.peak_bytes == 0
    assert measured.result.numel() == 100


def test_bad_device_type_and_nested_profiler_are_refused():
    # a bad device type counted nothing, silently, and a nested session
    # emptied the outer one's events (found by an adversarial search)
    from torch.profiler import profile

    from mmdtr.errors import MmdtrError
    for device_type in ('CPU', 'gpu', 'cuda:0'):
        with pytest.raises(MmdtrError, match='device_type=.* not accepted'):
            measure_memory(torch.zeros, (1024, ), device_type=device_type)
    assert measure_memory(
        torch.zeros, (1024, ), device_type=torch.device('cpu')).peak_bytes \
        == 4096
    with profile():
        with pytest.raises(MmdtrError, match='cannot be nested'):
            measure_memory(torch.zeros, (1024, ))


def test_frees_of_an_earlier_sessions_blocks_do_not_count():
    # the profiler reports the free of a block an earlier session
    # allocated: a second measurement read a peak of 0 and a negative end
    # (found by an adversarial search)
    keep = [torch.empty(100_000)]  # 400 kB, allocated before any session
    measure_memory(lambda: keep.append(torch.empty(100_000)))  # 400 kB more

    def step():
        keep.clear()  # frees both
        return torch.empty(50_000).sum()

    m = measure_memory(step)
    assert m.peak_bytes >= 200_000
    assert m.end_bytes >= 0
    assert m.freed_bytes < 400_000
