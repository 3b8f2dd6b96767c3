"""Which devices' storages an engine evicts (R11): those that lower memory
in use as it is metered. A CUDA device's counter sees its own storages
only; the CPU meter counts the storages of every device. CPU storages and
stubs stand in for CUDA ones; the CUDA run is in test_cuda.py."""
import pytest
import torch

from mmdtr.core.records import StorageRecord
from .eviction_stubs import EvictionsStub


class _GpuBytes:
    """Stands in for ``memory_allocated`` of cuda:0: bytes the engine
    cannot evict."""

    def __init__(self, nbytes):
        self.nbytes, self.peak = nbytes, 0

    def read(self):
        self.peak = max(self.peak, self.nbytes)
        return self.nbytes


def test_storages_of_another_device_are_no_candidates():
    # a CUDA engine evicted CPU storages, which free nothing it meters
    # (found by a review of the CUDA paths, with this stub)
    from mmdtr.dtr import DTR
    w = torch.randn(64, 64, requires_grad=True)
    with DTR(eviction_threshold=2**30, evictee_minimum_size=1) as engine:
        state = engine._state
        state.device, state.cuda = torch.device('cuda', 0), True
        meter = _GpuBytes(2**29)
        state.start_cuda_meter(meter)
        h = torch.randn(128, 64)
        for _ in range(6):
            h = torch.tanh(h @ w)
        assert not state.candidates
        meter.nbytes = 2**30 + 2**20  # over the threshold
        h = h * 1.0
        h.sum().backward()
    assert engine.stats.evictions == 0
    assert engine.stats.eviction_failures > 0


@pytest.mark.parametrize('metered, candidates', [
    ('cpu', ['cpu', 'cuda:0', 'cuda:1']),
    ('cuda:0', ['cuda:0']),
    ('cuda', ['cuda:0', 'cuda:1']),
    (None, ['cpu', 'cuda:0', 'cuda:1']),
])
def test_candidates_are_the_storages_the_meter_sees(metered, candidates):
    # a scope metered on CPU (a small CPU tensor made first decided it)
    # counts its CUDA storages too, so it may evict them; a CUDA device's
    # counter sees its own only. The CUDA-side filter, applied on CPU too,
    # left every CUDA activation resident in such a scope
    evictions = EvictionsStub(False, 2**20, False)
    evictions.device = None if metered is None else torch.device(metered)
    for clock, device in enumerate(['cpu', 'cuda:0', 'cuda:1']):
        rec = StorageRecord(2**10, torch.device(device), clock)
        rec.lo = 0  # recomputable
        evictions._add_candidate(rec)
    assert [str(rec.device) for rec in evictions.candidates] == candidates
