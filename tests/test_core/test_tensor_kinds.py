"""Tensor kinds at the edges of the engine (R4): quantized, sparse, nested
and subclass tensors, and forward AD's zero tangents, held (never evicted)
or kept whole.

Each case runs a step without DTR and under the smallest threshold, and
compares every returned tensor bit for bit (the ``same_under_dtr`` fixture).
Found by an adversarial search; each failed before its fix.
"""
import pytest
import torch
import torch.nn as nn

from mmdtr.dtr import DTR


@pytest.mark.filterwarnings('ignore:torch.quantize_per_tensor')
def test_quantized_tensors_are_held(same_under_dtr):
    x = torch.randn(8, 16)
    w = torch.randn(16, 16, requires_grad=True)

    def step():
        w.grad = None
        h = (x @ w).add(1)
        q = torch.quantize_per_tensor(h.detach(), 0.1, 0, torch.qint8)
        y = (h * q.dequantize()).exp().sin()
        del q, h
        loss = y.sum()
        loss.backward()
        return [loss, w.grad]

    same_under_dtr(step)


def test_sparse_tensors_are_held(same_under_dtr):
    adj = (torch.rand(8, 8) > 0.7).float().to_sparse()  # made outside
    x = torch.randn(8, 16)
    w = torch.randn(16, 16, requires_grad=True)

    def step():
        w.grad = None
        inside = (torch.rand(8, 8) > 0.5).float().to_sparse()
        h = torch.sparse.mm(adj, x @ w).relu()
        h = torch.sparse.mm(inside, h.exp()).sin()
        loss = h.sum()
        loss.backward()
        return [loss, w.grad]

    same_under_dtr(step)


@pytest.mark.parametrize('model', ['dropout_linear', 'mlp'])
def test_forward_ad_zero_tensors_are_held(same_under_dtr, model):
    # forward AD's missing tangents are efficient zero tensors: a size but
    # no data. Evicted and rebuilt as plain tensors over no data, backward
    # segfaulted or raised (found by an adversarial search)
    import torch.autograd.forward_ad as fwAD
    w = torch.randn(32, 16, requires_grad=True)
    v = torch.randn(32, 32, requires_grad=True)

    def step():
        w.grad = v.grad = None
        x, t = torch.randn(8, 16), torch.randn(8, 16)
        with fwAD.dual_level():
            h = nn.functional.linear(fwAD.make_dual(x, t), w)
            if model == 'dropout_linear':
                h = nn.functional.dropout(h, 0.3)
            else:
                h = nn.functional.linear(h.tanh(), v)
            primal, tangent = fwAD.unpack_dual(h)
            loss = primal.square().mean() + tangent.square().mean()
        loss.backward()
        return [loss, w.grad] + ([v.grad] if model == 'mlp' else [])

    assert same_under_dtr(step).recomputations > 0


def test_forward_ad_through_layer_norm_equals_an_empty_mode():
    # under any Python dispatch mode, forward AD's zero tangents go through
    # prims.mul/prims.add, which round otherwise than eager (design.md,
    # Limits): the engine, evicting, equals an empty mode bit for bit
    import torch.autograd.forward_ad as fwAD
    from torch.utils._python_dispatch import TorchDispatchMode

    class Empty(TorchDispatchMode):

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 1))

    def step():
        net.zero_grad(set_to_none=True)
        x, t = torch.randn(8, 16), torch.randn(8, 16)
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(net(fwAD.make_dual(x, t)))
            loss = (primal.sin() * tangent).sum()
        loss.backward()
        return [loss] + [p.grad for p in net.parameters()]

    torch.manual_seed(1)
    with Empty():
        expected = step()
    torch.manual_seed(1)
    with DTR(eviction_threshold=1, evictee_minimum_size=1) as engine:
        got = step()
    assert engine.stats.recomputations > 0
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_strided_nested_tensors_are_held(same_under_dtr):
    # a nested tensor has no strides to rebuild a view from: held (R4);
    # the engine crashed on it (an abort, from inside the dispatch mode)
    lin = nn.Linear(8, 8)

    def step():
        lin.zero_grad()
        nested = torch.nested.nested_tensor(
            [torch.randn(3, 8), torch.randn(5, 8)], requires_grad=True)
        out = torch.nested.to_padded_tensor(lin(nested).relu(), 0.0)
        loss = (out * 2).exp().sum()
        loss.backward()
        return [loss, lin.weight.grad, lin.bias.grad]

    same_under_dtr(step)


def test_saved_subclass_keeps_its_data():
    # a wrapper subclass saved for backward is kept as it is: detached below
    # its __torch_dispatch__ it would have no data
    from torch.testing._internal.two_tensor import TwoTensor
    grads = []
    for dtr in (False, True):
        torch.manual_seed(0)
        t = TwoTensor(torch.randn(64), torch.randn(64)).requires_grad_()
        with DTR(eviction_threshold='1GB', evictee_minimum_size=1) if dtr \
                else torch.enable_grad():
            (t * 1.0).sin().sum().backward()
        grads.append(t.grad)
    assert torch.equal(grads[0].a, grads[1].a)
    assert torch.equal(grads[0].b, grads[1].b)
