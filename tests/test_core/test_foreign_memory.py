"""Memory shared outside the dispatcher (DLPack, NumPy): a write through one
storage over it is a write to the others (R14)."""
import numpy as np
import pytest
import torch

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


def test_pairs_are_made_once_and_forgotten_with_the_storage():
    x, w = _inputs()
    with DTR(eviction_threshold='1GB') as engine:
        state = engine._state
        h = x @ w
        other = torch.from_numpy(np.ones(4, dtype=np.float32))  # its own
        other.mul_(2.0)
        other_cdata = other.untyped_storage()._cdata
        assert other_cdata in state.foreign and not state.shared_with
        del other
        assert other_cdata not in state.foreign  # forgotten when freed
        alias = torch.from_dlpack(h.detach())
        alias.add_(1.0)
        pair = [alias.untyped_storage()._cdata, h.untyped_storage()._cdata]
        assert sorted(state.shared_with) == sorted(pair)
        del alias
        assert not state.shared_with and not state.foreign
