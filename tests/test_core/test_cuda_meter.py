"""The CUDA meter's choice of reader, on CPU with a stand-in allocator.

On a GPU, tests/test_core/test_cuda.py checks it against the real one.
"""
import pytest
import torch

from mmdtr.core.cuda_meter import CudaAllocatedBytes


class FakeAllocator:
    """Stands in for the CUDA allocator's two ways to read its counter."""

    def __init__(self, nested=True, agree=True):
        self.allocated, self.nested, self.agree = 1234, nested, agree
        self.flattening_reads = 0

    def memory_stats(self, index):
        assert index == 3
        if not self.nested:
            return {}  # another layout
        return {'allocated_bytes': {'all': {'current': self.allocated}}}

    def memory_allocated(self, index=None):
        assert index == 3
        self.flattening_reads += 1
        return self.allocated + (0 if self.agree else 1)


@pytest.fixture
def allocator(monkeypatch, request):
    fake = FakeAllocator(**getattr(request, 'param', {}))
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 3)
    monkeypatch.setattr(
        torch._C, '_cuda_memoryStats', fake.memory_stats, raising=False)
    monkeypatch.setattr(torch.cuda, 'memory_allocated', fake.memory_allocated)
    return fake


def test_reads_the_nested_counter_after_one_check(allocator):
    meter = CudaAllocatedBytes(torch.device('cuda'))  # no index: current
    assert meter.read() == 1234 and meter.fast and meter.index == 3
    allocator.allocated = 999
    assert [meter.read() for _ in range(5)] == [999] * 5
    assert allocator.flattening_reads == 1  # the check alone


@pytest.mark.parametrize(
    'allocator', [dict(nested=False), dict(agree=False)], indirect=True)
def test_falls_back_to_memory_allocated(allocator):
    meter = CudaAllocatedBytes(torch.device('cuda', 3))
    meter.read()
    assert meter.fast is False
    allocator.allocated, before = 999, allocator.flattening_reads
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
