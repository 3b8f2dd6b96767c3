"""Storages and views swapped under a tensor (``set_``, ``.data = ...``),
and storages resized below the dispatcher.

No bytes change, but a tensor points at other ones: eager's backward reads
what its saved tensors point at now; the engine holds the storage of the
save, so it refuses (``MmdtrError``, or autograd's in-place error where
eager raises it) instead of giving another gradient, and lets through what
writes nothing (R5, R10). Each case failed on an engine before its fix.
"""
import pytest
import torch
import torch.nn as nn

from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError


def test_leaf_storage_swapped_mid_step_raises():
    # `p.data = t` moves no version counter: a rebuild would read the new
    # storage, so the engine refuses it instead (a clear error, never a
    # silently different gradient)
    x = torch.randn(8, 16)
    b = nn.Parameter(torch.randn(16))
    with DTR(eviction_threshold=1, evictee_minimum_size=1):
        h = (x + b).exp().sin()  # exp's output is rebuilt from add(x, b)
        b.data = torch.zeros(16)
        with pytest.raises(MmdtrError, match=r'tensor\.data = \.\.\.'):
            h.sum().backward()


def test_set_on_a_saved_tensor_is_refused(refused_like_eager):
    # set_ bumps the tensor's version and points it at another storage: the
    # write belongs to the old storage, the saved one (R10)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)

    def step():
        a = x @ w
        y = a.sin()  # saves a
        with torch.no_grad():
            a.set_(torch.randn(8, 16))
        torch.randn(64, 64).exp()
        y.sum().backward()

    refused_like_eager(step)


def test_set_on_an_input_from_outside(same_under_dtr):
    # a recipe holds a leaf from outside as the tensor itself: set_ points
    # it at other bytes, so its readers are frozen first (R7); a rebuild
    # used to raise MmdtrError where eager runs backward (found by an
    # adversarial search)
    w = torch.randn(16, 16, requires_grad=True)

    def step(x):
        w.grad = None
        y = ((x + 1.0) @ w).tanh()  # mm saves x + 1, rebuilt from x
        with torch.no_grad():
            x.set_(torch.zeros(8, 16))
        torch.randn(64, 64).exp()
        loss = y.sum()
        loss.backward()
        return [loss, w.grad, x]

    same_under_dtr(step, setup=lambda: torch.randn(8, 16))


def test_set_onto_a_saved_tensor_writes_nothing(same_under_dtr):
    # the source of set_ is neither written nor versioned; the engine saw a
    # write to it (the storage the target has after the call) and refused
    # backward where eager runs it
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)

    def step():
        w.grad = None
        b = (x @ w).exp()  # exp saves its output b
        a = torch.zeros(3)
        with torch.no_grad():
            a.set_(b)
        loss = b.sin().sum()
        loss.backward()
        return [loss, w.grad, a]

    same_under_dtr(step)


def test_write_after_data_was_swapped_is_refused(refused_like_eager):
    # .data = swaps the storage without a version bump; a later write moves
    # the counter of the tensor object, not that of the old storage's
    # alias, which an eviction had dropped: the object's counter is read
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def step():
        e = (x @ w).exp()  # saves its output e
        e.data = torch.zeros(4, 8)
        torch.randn(64, 64).exp()  # evicts e's old storage
        with torch.no_grad():
            e.add_(1)
        e.sum().backward()

    refused_like_eager(step)


@pytest.mark.parametrize('new', ['storage', 'view'])
def test_saved_tensor_given_another_storage_is_refused(new):
    # eager would read the new storage (or view) through its saved tensor;
    # the engine holds the old one: a clear error, not another gradient
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8)
    with DTR(eviction_threshold=2**40, evictee_minimum_size=1):
        h = x @ w
        y = h.sin()  # saves h
        h.data = torch.zeros(8, 8) if new == 'storage' else h.data.t()
        with pytest.raises(MmdtrError, match=r'\.data = \.\.\.'):
            y.sum().backward()


def test_activation_freed_below_the_dispatcher_is_rebuilt(same_under_dtr):
    # untyped_storage().resize_(0) moves no counter and is no dispatcher
    # op: a rebuild of relu(a) read a's freed bytes (wrong gradients, found
    # by an adversarial search); the version relu read is rebuilt (R13)
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(4)]
    x = torch.randn(8, 16)
    kept = []

    def step():
        for w in ws:
            w.grad = None
        h = x
        for i, w in enumerate(ws):
            a = h @ w
            h = a.relu()  # saves its output: eager never reads a again
            if i == 1:
                a.untyped_storage().resize_(0)
                kept.append(a)
        h.sum().backward()
        return [w.grad for w in ws]

    stats = same_under_dtr(step)
    assert stats.recomputations > 0
    assert kept[-1].untyped_storage().nbytes() == 0  # the user's, as left


def test_input_freed_below_the_dispatcher_is_refused():
    # eager never reads x after x * 2; a rebuild of x * 2 would read freed
    # memory (a segfault before the fix): refused instead (R13)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    with DTR(eviction_threshold=1, evictee_minimum_size=1):
        y = ((x * 2).tanh() @ w).sum()  # tanh's output is rebuilt from x
        x.untyped_storage().resize_(0)
        with pytest.raises(
                MmdtrError, match='has 0 bytes and the tensor '
                'reads 512'):
            y.backward()


@pytest.mark.parametrize('swap', ['data', 'set_', 'detach', 'view'])
def test_a_write_after_a_tensor_moved_off_a_read_storage_runs(
        swap, same_under_dtr):
    # a tensor moved to another storage keeps the counter it shares with
    # the tensors left on the old one (its views, its detach(), its base);
    # a write there, which the engine sees, moved their counter, and the
    # in-scope check for writes from another thread (R13) refused (found
    # by two reviews); the version read is rebuilt instead
    w = torch.randn(50, requires_grad=True)

    def step():
        w.grad = None
        x = torch.randn(100) + 1
        left = x.detach() if swap == 'detach' else x[:50]
        moved = left if swap == 'view' else x
        e = left[:50].exp()  # reads the storage as it is
        loss = (e * w).sum()  # saves e, evicted
        del e
        if swap == 'set_':
            x.set_(torch.zeros(100))
            loss = loss + (left.sin() * w).sum()  # a read after set_
        else:
            moved.data = torch.zeros(moved.shape)
        moved.add_(1)
        loss.backward()
        return [loss, w.grad, x, left]

    assert same_under_dtr(step).recomputations > 0
