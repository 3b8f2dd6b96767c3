"""Unit tests of the cost model (rule R9 of docs/design.md).

No engine: the module's functions are called on small hand-made calls. A
cost is FLOPs from ``torch.utils.flop_counter``'s formulas where it has one,
else the bytes of the call's tensors times ``FLOPS_PER_BYTE``, at least 1;
no timer is read.
"""
import ast
import functools
import gc
import inspect
import time
import weakref

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from mmdtr.core import cost_model
from mmdtr.core.cost_model import (FLOPS_PER_BYTE, op_cost, tensor_bytes,
                                   tensors_bytes)

aten = torch.ops.aten


def counted_flops(func, *args, **kwargs):
    """FLOPs torch.utils.flop_counter counts for actually running a call."""
    with FlopCounterMode(display=False) as mode:
        func(*args, **kwargs)
    return mode.get_total_flops()


def test_tensor_bytes_counts_elements_not_storage():
    assert tensor_bytes(torch.zeros(3, 5)) == 3 * 5 * 4
    assert tensor_bytes(torch.zeros(3, 5, dtype=torch.float16)) == 3 * 5 * 2
    assert tensor_bytes(torch.zeros(7, dtype=torch.int64)) == 7 * 8
    # an expanded view addresses 1000 x 4 elements over a storage of 4
    assert tensor_bytes(torch.zeros(1, 4).expand(1000, 4)) == 1000 * 4 * 4
    assert tensor_bytes(torch.zeros(8)[::2]) == 4 * 4
    assert tensor_bytes(torch.empty(0)) == 0


def test_tensors_bytes_recurses_into_nested_lists_and_tuples():
    t1, t2 = torch.zeros(2), torch.zeros(3, dtype=torch.float64)
    t3, t4 = torch.zeros(5, dtype=torch.int8), torch.zeros(7)
    nested = [t1, (t2, [t3, (t4, )]), 3, None, 'x', 2.5]
    assert tensors_bytes(nested) == 2 * 4 + 3 * 8 + 5 * 1 + 7 * 4
    assert tensors_bytes([[[[[t4]]]]]) == 7 * 4
    assert tensors_bytes(()) == 0
    assert tensors_bytes([1, 'a', None]) == 0


def test_matmul_cost_is_flop_counters_formula():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    out = aten.mm.default(a, b)
    cost = op_cost(aten.mm.default, (a, b), {}, out)
    assert cost == flop_registry[aten.mm](a, b, out_val=out)
    assert cost == 2 * 3 * 5 * 7
    assert cost == counted_flops(aten.mm.default, a, b)
    assert isinstance(cost, float)


def test_batched_and_fused_matmul_costs_are_flop_counters():
    a, b = torch.randn(2, 3, 5), torch.randn(2, 5, 7)
    out = aten.bmm.default(a, b)
    assert op_cost(aten.bmm.default, (a, b), {}, out) == \
        counted_flops(aten.bmm.default, a, b) == 2 * 2 * 3 * 5 * 7
    bias, a, b = torch.randn(3, 7), torch.randn(3, 5), torch.randn(5, 7)
    kwargs = dict(beta=2, alpha=3)  # keyword arguments reach the formula
    out = aten.addmm.default(bias, a, b, **kwargs)
    assert op_cost(aten.addmm.default, (bias, a, b), kwargs, out) == \
        counted_flops(aten.addmm.default, bias, a, b, **kwargs)


def test_convolution_cost_is_flop_counters():
    x, w, bias = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), \
        torch.randn(4)
    args = (x, w, bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    out = aten.convolution.default(*args)
    cost = op_cost(aten.convolution.default, args, {}, out)
    assert cost == counted_flops(aten.convolution.default, *args)
    # 2 * (output elements) * (input channels * kernel area)
    assert cost == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)


def test_non_compute_op_costs_its_bytes_moved():
    a, b = torch.randn(3, 5), torch.randn(3, 5, dtype=torch.float64)
    out = aten.add.Tensor(a, b)
    moved = 15 * 4 + 15 * 8 + 15 * 8  # inputs and output
    assert aten.add not in flop_registry
    assert op_cost(aten.add.Tensor, (a, b), {}, out) == moved * FLOPS_PER_BYTE
    # scalar arguments move nothing; keyword tensors are read too
    assert op_cost(aten.add.Tensor, (a, 2.0), {}, a + 2) == \
        (15 * 4 * 2) * FLOPS_PER_BYTE
    assert op_cost(aten.add.Tensor, (a, ), {'other': b}, out) == \
        moved * FLOPS_PER_BYTE


def test_bytes_moved_count_every_output_of_a_multi_output_op():
    a = torch.randn(3, 5)
    out = aten.max.dim(a, 1)  # (values, indices)
    moved = 15 * 4 + 3 * 4 + 3 * 8
    assert op_cost(aten.max.dim, (a, 1), {}, out) == moved * FLOPS_PER_BYTE
    tensors = [torch.randn(4), torch.randn(6)]
    out = aten._foreach_neg.default(tensors)
    assert op_cost(aten._foreach_neg.default, (tensors, ), {}, out) == \
        (10 * 4 * 2) * FLOPS_PER_BYTE


def test_bytes_are_costed_at_flops_per_byte(monkeypatch):
    a = torch.randn(4)
    out = aten.neg.default(a)
    monkeypatch.setattr(cost_model, 'FLOPS_PER_BYTE', 2.0)
    assert op_cost(aten.neg.default, (a, ), {}, out) == 4 * 4 * 2 * 2.0


def test_a_formula_that_cannot_read_the_call_falls_back_to_bytes():
    v, b = torch.randn(5), torch.randn(5, 7)  # mm's formula wants 2-D
    out = torch.randn(3, 7)
    moved = 5 * 4 + 35 * 4 + 21 * 4
    assert op_cost(aten.mm.default, (v, b), {}, out) == \
        moved * FLOPS_PER_BYTE


def test_cost_is_at_least_one():
    e = torch.empty(0)
    assert op_cost(aten.add.Tensor, (e, e), {}, e) == 1.0
    a, b = torch.randn(3, 0), torch.randn(0, 7)  # 0 FLOPs
    assert op_cost(aten.mm.default, (a, b), {}, torch.zeros(3, 7)) == 1.0
    assert op_cost(aten.sym_size.int, (e, 0), {}, 0) == 1.0


def test_raw_formula_gets_shapes_and_unwrapped_one_gets_the_call(monkeypatch):
    seen = {}

    def raw(a_shape, b_shape, *, out_shape=None, **kwargs):
        seen['raw'] = (a_shape, b_shape, out_shape, kwargs)
        return 11

    @functools.wraps(raw)
    def wrapped(*args, **kwargs):
        raise AssertionError('the shape wrapper is bypassed')

    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = aten.sub.Tensor(a, b)
    monkeypatch.setitem(flop_registry, aten.sub, wrapped)
    assert op_cost(aten.sub.Tensor, (a, b), {'alpha': 2}, out) == 11.0
    assert seen['raw'] == (a.shape, b.shape, out.shape, {'alpha': 2})

    def unwrapped(*args, out_val=None, **kwargs):
        seen['plain'] = (args, out_val, kwargs)
        return 13

    monkeypatch.setitem(flop_registry, aten.sub, unwrapped)
    assert op_cost(aten.sub.Tensor, (a, b), {'alpha': 2}, out) == 13.0
    args, out_val, kwargs = seen['plain']
    assert args[0] is a and args[1] is b and out_val is out
    assert kwargs == {'alpha': 2}


def test_costing_keeps_no_reference_to_the_call():
    # the raw formula on shapes, not pytree's wrapper, so that no cycle
    # keeps the op's tensors alive until the next collection
    gc.disable()
    try:
        a, b = torch.randn(3, 5), torch.randn(5, 7)
        out = aten.mm.default(a, b)
        refs = [weakref.ref(t) for t in (a, b, out)]
        op_cost(aten.mm.default, (a, b), {}, out)
        op_cost(aten.mm.default, (a.view(15), b), {}, out)  # fallback
        del a, b, out
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


_TIMERS = ('perf_counter', 'perf_counter_ns', 'monotonic', 'monotonic_ns',
           'time', 'time_ns', 'process_time', 'process_time_ns', 'thread_time',
           'thread_time_ns')


def test_no_timer_is_read(monkeypatch):

    def timer(*args, **kwargs):
        raise AssertionError('the cost model read a timer')

    for name in _TIMERS:
        monkeypatch.setattr(time, name, timer)
    monkeypatch.setattr(torch.cuda, 'synchronize', timer)
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    x, w = torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    calls = [
        (aten.mm.default, (a, b), {}, a @ b),
        (aten.convolution.default, args, {}, aten.convolution.default(*args)),
        (aten.add.Tensor, (a, a), {}, a + a),
        (aten.mm.default, (a.view(15), b), {}, a @ b),
    ]
    for func, args, kwargs, out in calls:
        assert op_cost(func, args, kwargs, out) >= 1.0
    # nor is a timer imported under another name, out of reach of the above
    tree = ast.parse(inspect.getsource(cost_model))
    imported = {
        alias.name.split('.')[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    } | {
        node.module.split('.')[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {'time', 'timeit', 'datetime'}
    assert not set(_TIMERS) & set(vars(cost_model))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_formula_cost_does_not_depend_on_dtype(dtype):
    # FLOPs, not bytes: a matmul in half the bytes costs the same
    a, b = torch.randn(4, 6, dtype=dtype), torch.randn(6, 2, dtype=dtype)
    assert op_cost(aten.mm.default, (a, b), {}, a @ b) == 2 * 4 * 6 * 2
