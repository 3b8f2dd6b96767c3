"""The engine's CPU meter, checked independently with torch.profiler."""
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from mmdtr.dtr import DTR
from mmdtr.utils.profiler_memory import measure_peak_memory


class LargestOpWorkingSet(TorchDispatchMode):
    """Max over ops of the bytes of their tensor inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values()]
        flat += list(out) if isinstance(out, (tuple, list)) else [out]
        size = sum(t.untyped_storage().nbytes() for t in flat
                   if isinstance(t, torch.Tensor))
        self.largest = max(self.largest, size)
        return out


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16),
            nn.ReLU(inplace=True)) for _ in range(8)
    ])


def _step(model, x, threshold):
    model.zero_grad(set_to_none=True)
    with DTR(eviction_threshold=threshold, evictee_minimum_size=1) as e:
        model(x).square().sum().backward()
    return e.stats


def test_meter_equals_profiler_when_nothing_is_evicted():
    model, x = _model(), torch.randn(8, 16, 32, 32)
    _step(model, x, 2**40)  # warm-up: lazy initializations allocate
    stats, profiled = measure_peak_memory(_step, model, x, 2**40)
    assert stats.evictions == 0
    assert stats.peak_memory == profiled


def test_profiled_peak_stays_within_threshold_plus_largest_op():
    model, x = _model(), torch.randn(8, 16, 32, 32)
    baseline = _step(model, x, 2**40).peak_memory
    with LargestOpWorkingSet() as probe:
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
    for fraction in (0.5, 0.3):
        threshold = int(baseline * fraction)
        stats, profiled = measure_peak_memory(_step, model, x, threshold)
        assert stats.evictions > 0 and stats.eviction_failures == 0
        assert stats.peak_memory <= threshold + probe.largest
        assert profiled <= threshold + probe.largest, (profiled, threshold,
                                                       probe.largest)
        assert profiled < baseline
