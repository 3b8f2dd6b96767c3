"""Writes through tensor subclasses (R5, R7): a plain subclass's and a
traceable wrapper's, whose parts the subclass writes in its own dispatch.

Each case runs a step without DTR and under the smallest threshold, and
compares every returned tensor bit for bit (the ``same_under_dtr`` fixture).
Found by reviews; each failed before its fix.
"""
import pytest
import torch
from torch.utils._pytree import tree_map


class _PassThrough(torch.Tensor):
    """A tensor subclass that runs every op on its plain tensors."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):

        def plain(a):
            if isinstance(a, _PassThrough):
                with torch._C._DisableTorchDispatch():
                    return a.as_subclass(torch.Tensor)
            return a

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


@pytest.mark.fails_before_torch(
    (2, 6),
    reason='this test\'s pass-through subclass cannot go back to '
    'a plain tensor (as_subclass) on PyTorch 2.4 and 2.5')
def test_write_through_a_subclass_is_seen(same_under_dtr):

    def setup():
        return torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)

    def step(made):
        x, w = made
        h = x @ w
        b = h * 3  # reads h at version 0
        c = b.sin()  # saves b
        with torch.no_grad():
            h.as_subclass(_PassThrough).add_(1)
        del b
        (c.exp() + h.sum()).sum().backward()
        return [w.grad]

    assert same_under_dtr(step, setup).evictions > 0


def test_write_through_a_wrapper_subclass_is_seen(same_under_dtr):
    # a wrapper subclass writes the tensors it holds in its own dispatch,
    # where the engine sees nothing: a recipe that read one rebuilt from
    # the new values (found by a review: another gradient)
    from torch.testing._internal.two_tensor import TwoTensor

    def step():
        w = torch.randn(64, requires_grad=True)
        a, b = torch.randn(64) + 1, torch.randn(64) + 1
        e = a.exp()  # reads a at version 0
        loss = (e * w).sum()  # saves e, evicted
        del e
        TwoTensor(a, b).add_(1)
        torch.randn(64).mul_(2)  # an op that evicts
        loss.backward()
        return [loss, w.grad, a, b]

    assert same_under_dtr(step).recomputations > 0


class _OptionalPart(torch.Tensor):
    """A wrapper subclass whose ``__tensor_flatten__`` lists a part that
    may be ``None``, and a number."""

    @staticmethod
    def __new__(cls, a):
        return torch.Tensor._make_wrapper_subclass(
            cls, a.shape, dtype=a.dtype, device=a.device)

    def __init__(self, a):
        self.a, self.b, self.n = a, None, 3

    def __tensor_flatten__(self):
        return ['a', 'b', 'n'], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        inner = [x.a if isinstance(x, _OptionalPart) else x for x in args]
        func(*inner, **(kwargs or {}))
        return args[0]  # in-place ops only, here


def test_write_through_a_wrapper_with_an_optional_part(same_under_dtr):
    # a part listed but None (or not a tensor) raised AttributeError in the
    # engine (a review)
    def step():
        w = torch.randn(64, requires_grad=True)
        a = torch.randn(64) + 1
        e = a.exp()
        loss = (e * w).sum()
        del e
        _OptionalPart(a).add_(1)
        torch.randn(64).mul_(2)  # an op that evicts
        loss.backward()
        return [loss, w.grad, a]

    assert same_under_dtr(step).recomputations > 0
