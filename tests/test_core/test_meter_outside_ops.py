"""The CPU meter on storages made outside ops (``torch.tensor`` of a list,
NumPy arrays, sparse parts) and on the parts of nested and quantized
tensors, checked against torch.profiler's live bytes."""
import time

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from mmdtr.dtr import DTR


def _metered_and_live(make, recording_threshold=None):
    """(the meter, the profiler's live bytes) just after ``make()`` runs in
    a new scope."""
    with profile(
            activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with DTR(
                eviction_threshold='2GB',
                recording_threshold=recording_threshold) as engine:
            kept = make()  # noqa: F841 (alive while read)
            metered, when = engine._state.in_use, time.time_ns()
    live = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
               if e.name() == '[memory]' and e.device_type().name == 'CPU'
               and e.start_ns() <= when)
    return metered, live


_ROWS = torch.rand(256, 1024).tolist()  # 1 MiB as float32


def _parts(sparse):
    return sparse, sparse._indices(), sparse._values()


@pytest.mark.parametrize('case', [
    'tensor_of_a_list', 'new_tensor', 'tensor_of_numpy', 'as_tensor_of_numpy',
    'sparse_gradient', 'sparse_gradient_accumulated', 'sparse_add_',
    'sparse_of_outside_indices'
])
def test_meter_counts_storages_made_outside_ops(case):
    """Found by an adversarial search: ``torch.tensor(list)`` reaches the
    engine as ``lift_fresh`` of a tensor made outside the dispatcher, which
    was taken for a view of an outside storage, and a sparse gradient's
    parts were not counted (the outside indices' storage was): detection
    targets built from lists in forward took the profiled peak over the
    threshold plus the largest op."""
    base = torch.randn(4)
    array = torch.rand(256, 1024, dtype=torch.float64).numpy()
    embedding = nn.Embedding(20000, 64, sparse=True)
    indices = torch.randint(0, 20000, (4096, ))
    other = torch.sparse_coo_tensor(indices[None], torch.ones(4096, 3),
                                    (20000, 3))

    def accumulate():  # AccumulateGrad: grad += new, a sparse add_
        embedding(indices).sum().backward()
        embedding(indices).sum().backward()

    make = dict(
        tensor_of_a_list=lambda: torch.tensor(_ROWS),
        new_tensor=lambda: base.new_tensor(_ROWS),
        tensor_of_numpy=lambda: torch.tensor(array),  # a copy: counted once
        as_tensor_of_numpy=lambda: torch.as_tensor(array),  # NumPy's memory
        sparse_gradient=lambda: embedding(indices).sum().backward(),
        sparse_gradient_accumulated=accumulate,
        sparse_add_=lambda: torch.sparse_coo_tensor(indices[None],
                                                    torch.ones(4096, 3),
                                                    (20000, 3)).add_(other),
        sparse_of_outside_indices=lambda: _parts(
            torch.sparse_coo_tensor(indices[None], torch.ones(4096),
                                    (20000, ))),
    )[case]
    make()  # warm-up: lazy initializations allocate
    embedding.weight.grad = None
    metered, live = _metered_and_live(make)
    assert metered == live, (metered, live)
    if case == 'as_tensor_of_numpy':
        assert metered == 0  # NumPy's memory
    else:
        assert metered >= 2**14


_FLAT = torch.randn(1 << 16)  # 256 KiB, from before the scope


def _nested():
    return torch.nested.nested_tensor(
        [_FLAT.view(256, 256), _FLAT[:1000].view(10, 100)])


@pytest.mark.parametrize(
    'recording_threshold', [None, '1GB'], ids=['recording', 'idle'])
@pytest.mark.parametrize('case', [
    'quantize', 'quantize_per_channel', 'quantized_add', 'nested',
    'nested_ops', 'nested_of_outside_sin', 'nested_of_outside_mul_',
    'nested_of_outside_unbind', 'padded_of_outside_nested'
])
def test_meter_counts_nested_and_quantized_storages(case, recording_threshold):
    """Found by an adversarial search: the storages of nested and
    quantized outputs (held, never recorded) were not metered at all, so
    the peak and the threshold saw less than was allocated; those of a
    nested tensor from before the scope are not counted again."""
    quantized = torch.quantize_per_tensor(_FLAT, 0.1, 0, torch.quint8)
    outside = _nested()
    make = dict(
        quantize=lambda: torch.quantize_per_tensor(_FLAT, 0.1, 0, torch.quint8
                                                   ),
        quantize_per_channel=lambda: torch.quantize_per_channel(
            _FLAT.view(256, 256),
            torch.rand(256) + 0.1, torch.zeros(256, dtype=torch.long), 0, torch
            .qint8),
        quantized_add=lambda: torch.ops.quantized.add(quantized, quantized,
                                                      0.2, 0),
        nested=_nested,
        nested_ops=lambda: (lambda nt: (nt, nt.sin(), nt * 2))(_nested()),
        nested_of_outside_sin=lambda: outside.sin(),
        nested_of_outside_mul_=lambda: outside.mul_(1),
        nested_of_outside_unbind=lambda: outside.unbind(),
        padded_of_outside_nested=lambda: torch.nested.to_padded_tensor(
            outside, 0.0),
    )[case]
    make()  # warm-up: lazy initializations allocate
    metered, live = _metered_and_live(make, recording_threshold)
    assert metered == live, (metered, live)
    if 'outside_mul_' in case or 'outside_unbind' in case:
        assert metered == 0
    else:
        assert metered >= 2**16
