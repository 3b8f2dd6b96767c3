"""Tensors ``set_`` pointed at a storage in scope, written after the scope
closed, before backward (R13): tracked as the views ops return are, but for
a view of a base elsewhere. The helpers are test_writes_after_scope.py's."""
import pytest
import torch

from mmdtr.errors import MmdtrError
from .test_writes_after_scope import _chain_after, _run, _same_as_eager

SET_ONTO = {
    'storage':
    lambda t: torch.empty(0).set_(t.untyped_storage()),
    'tensor':
    lambda t: torch.empty(0).set_(t.detach()),
    'storage_view':
    lambda t: torch.empty(0).set_(t.untyped_storage(), 0, (32, 32), (32, 1)),
}


@pytest.mark.parametrize('onto', sorted(SET_ONTO))
def test_tensor_set_onto_an_activation_in_scope_written_after_it(onto):
    # d = empty(0).set_(h's storage) in scope has a counter of its own and
    # was not tracked (set_ returned no new storage): its write after the
    # scope went unseen and a rebuild read the new bytes (found by an
    # adversarial search). The record rebuilds the version read instead
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(32, 32)

    def forward():
        h = x @ w
        return _chain_after(h, w), SET_ONTO[onto](h)

    _same_as_eager(forward, lambda d: d.add_(1), w)


def test_tensor_set_onto_an_input_in_scope_written_after_it_is_refused():
    # the same over an input from outside, which no recipe rebuilds
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(32, 32)

    def forward():
        return _chain_after(x @ w, w), SET_ONTO['storage'](x)

    _run(forward, lambda d: d.add_(1), False, w)  # eager runs
    with pytest.raises(MmdtrError, match='after the DTR scope closed'):
        _run(forward, lambda d: d.add_(1), True, w)


def test_view_set_onto_an_input_in_scope_then_its_base_written():
    # v = buf[:4].set_(x's storage) shares buf's counter: a write to buf
    # after the scope writes no byte of x, but moved v's counter and was
    # refused once v was tracked (found by a review of that change)
    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    x, buf = torch.randn(32, 32), torch.zeros(64)

    def forward():
        return _chain_after(x @ w, w), buf[:4].set_(x.untyped_storage())

    _same_as_eager(forward, lambda v: buf.add_(1), w)
