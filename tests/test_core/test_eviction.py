"""Eviction's candidates (mmdtr/core/eviction.py), driven on CPU."""
from types import SimpleNamespace

import pytest
import torch

from mmdtr.core.engine import EngineState
from mmdtr.core.policies import build_policy

A = torch.ops.aten


@pytest.mark.parametrize('metered', ['cpu', 'cuda'])
def test_only_storages_on_the_metered_device_are_candidates(metered):
    # a CPU storage in a scope metered on CUDA was evicted to free CUDA
    # memory, which it holds none of, and recomputed for nothing (R3)
    state = EngineState(1, 0, False, build_policy('dtr'), 'cpu')
    if metered == 'cuda':  # the CUDA meter, driven on CPU
        state.device, state.cuda = torch.device('cuda', 0), True
        state.start_cuda_meter(SimpleNamespace(read=lambda: 0, peak=0))
    x = torch.randn(64, 64, requires_grad=True)
    with state.lock:  # as the dispatch mode and the hooks call it (R12)
        y = state.on_op(A.mul.Tensor, (x, x), {})
        handle = state.pack(y)
    rec = state.records[y.untyped_storage()._cdata]
    assert rec.handles == 1 and rec.recomputable(rec.version)
    assert (rec.cand_index >= 0) == (metered == 'cpu')
    assert state.candidates == ([rec] if metered == 'cpu' else [])
    del handle


@pytest.mark.parametrize('metered, device, candidate', [
    ('cuda', 'cuda:1', True),
    ('cuda:0', 'cuda:0', True),
    ('cuda:0', 'cuda:1', False),
    ('cuda:1', 'cpu', False),
    ('cpu', 'cpu', True),
    ('cpu', 'cuda:0', False),
])
def test_a_device_is_metered_by_its_type_and_index(metered, device, candidate):
    state = EngineState(1, 0, False, build_policy('dtr'), None)
    state.device = torch.device(metered)  # 'cuda': whichever is current
    assert state._on_metered_device(torch.device(device)) == candidate
