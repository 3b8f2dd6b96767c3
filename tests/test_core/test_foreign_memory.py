"""Memory shared outside the dispatcher (DLPack, NumPy): a write through one
storage over it is a write to the others (R14)."""
import numpy as np
import pytest
import torch

from mmdtr.core.foreign_memory import AddressIndex
from mmdtr.dtr import DTR

ALIASES = {
    'dlpack': lambda t: torch.from_dlpack(t.detach()),
    'numpy': lambda t: torch.from_numpy(t.detach().numpy()),
    'dlpack_of_a_view': lambda t: torch.from_dlpack(t.detach()[1:]),
}


def _inputs():
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    return x, w.requires_grad_()


def _grad(body, x, w, threshold):
    """``w``'s gradient from ``body``, without DTR (threshold None) or under
    it with everything evictable; and the engine's stats."""
    w.grad = None
    if threshold is None:
        body(x, w)
        return w.grad, None
    with DTR(eviction_threshold=threshold, evictee_minimum_size=1) as engine:
        body(x, w)
    return w.grad, engine.stats


def _write_through_alias(alias):

    def body(x, w):
        h = x @ w  # recorded
        g = (h * 1.0).exp()  # saved, then evicted: rebuilt from h
        loss = (g * g.detach()).sum()
        del g
        torch.ones(2**16).sum()  # memory rises: g is evicted here
        alias(h).mul_(0.0)  # h's memory, through another storage
        loss.backward()

    return body


def _write_seen_read_through_alias(alias):

    def body(x, w):
        h = x @ w.detach()  # recorded; w's gradient comes below
        shared = alias(h)
        g = (shared * 1.0 + w[0]).exp()  # its recipe holds the alias
        loss = (g * g.detach()).sum()
        del g
        torch.ones(2**16).sum()  # memory rises: g is evicted here
        h.mul_(0.0)  # seen: a write to h's record
        loss.backward()

    return body


def _write_through_alias_of_an_input(alias):

    def body(x, w):
        u = x + w[0]  # its recipe holds x, made before the scope
        g = u.exp()
        loss = (g * g.detach()).sum()
        del u, g
        torch.ones(2**16).sum()  # memory rises: g is evicted here
        alias(x).add_(1.0)  # x's counter does not move
        loss.backward()

    return body


@pytest.mark.parametrize('alias', sorted(ALIASES))
@pytest.mark.parametrize('make_body', [
    _write_through_alias, _write_seen_read_through_alias,
    _write_through_alias_of_an_input
])
def test_a_write_to_shared_memory_writes_each_storage(make_body, alias):
    # the engine knows storages by their StorageImpl: a write through a
    # DLPack or NumPy alias was not seen as one to the recorded storage,
    # and a rebuild read the written memory (found by an adversarial
    # search: wrong gradients after one eviction)
    body = make_body(ALIASES[alias])
    x, w = _inputs()
    grad_ref, _ = _grad(body, x.clone(), w, None)
    grad, stats = _grad(body, x.clone(), w, threshold=1)
    assert torch.equal(grad, grad_ref)
    assert stats.evictions > 0 and stats.recomputations > 0


def test_a_write_through_an_alias_seen_first_reaches_a_later_reader():
    # the alias was compared once, when first written, before a recipe
    # held the input made before the scope that it shares memory with
    # (found by a review)
    def body(t, shared, w):
        shared.add_(0.0)  # seen before any recipe reads t
        y = t * w  # its recipe holds t
        z = y.sin()  # saves y
        del y
        torch.ones(2**16).sum()  # memory rises: y is evicted here
        shared.add_(1.0)  # t's memory
        z.sum().backward()

    def run(threshold):
        t = torch.arange(8.0)
        w = torch.linspace(0.5, 1.5, 8).requires_grad_()
        if threshold is None:
            body(t, torch.from_dlpack(t), w)
            return w.grad, None
        with DTR(
                eviction_threshold=threshold,
                evictee_minimum_size=1) as engine:
            body(t, torch.from_dlpack(t), w)
        return w.grad, engine.stats

    grad_ref, _ = run(None)
    grad, stats = run(threshold=1)
    assert torch.equal(grad, grad_ref) and stats.recomputations > 0


def test_address_index():
    disjoint = AddressIndex(disjoint=True)
    for start, cdata in ((100, 1), (0, 2), (300, 3)):
        disjoint.add(start, start + 50, cdata)
    assert disjoint.overlapping(120, 121) == [1]
    assert sorted(disjoint.overlapping(40, 320)) == [1, 2, 3]
    assert disjoint.overlapping(50, 100) == []  # ends are exclusive
    disjoint.remove(100, 1)
    assert disjoint.overlapping(0, 400) == [3, 2] and len(disjoint) == 2
    nested = AddressIndex(disjoint=False)  # aliases of one array overlap
    nested.add(0, 1000, 1)
    nested.add(10, 20, 2)
    nested.add(500, 510, 3)
    assert sorted(nested.overlapping(505, 506)) == [1, 3]
    assert nested.overlapping(30, 40) == [1]


def test_the_indexes_follow_the_storages():
    x, w = _inputs()
    with DTR(eviction_threshold='1GB') as engine:
        state = engine._state

        def indexed(indexes):
            return {c for index in indexes.values() for c in index.cdatas}

        h = x @ w  # recorded; its recipe holds x and w from outside
        held = {t.untyped_storage()._cdata for t in (x, w)}
        h_cdata = h.untyped_storage()._cdata
        assert indexed(state.address_index) == held | {h_cdata}
        other = torch.from_numpy(np.ones(16, dtype=np.float32))
        y = other * w[0]  # held from outside, not resizable
        assert indexed(state.foreign_index) == {other.untyped_storage()._cdata}
        del h, y, other  # freed: out of the indexes
        assert indexed(state.address_index) == held
        assert not state.foreign_index
