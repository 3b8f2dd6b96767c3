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


def test_a_write_through_an_alias_of_moved_memory_is_seen():
    # an input held by a recipe, then moved by resize_: indexed at its
    # first address, a write through an alias of its new memory was missed
    # (found by a review)
    def run(threshold):
        x = torch.randn(256, generator=torch.Generator().manual_seed(0))
        w = torch.randn(256, generator=torch.Generator().manual_seed(1))
        w.requires_grad_()

        def body():
            u0 = x + w  # a recipe holds x
            x.resize_(4096)  # x's memory moves
            x[256:].zero_()
            u = x[:256] + w
            g = u.sin()
            loss = g.sum() + u0.sum()
            del u, g
            torch.ones(2**14).sum()  # memory rises: u is evicted here
            torch.from_numpy(x.numpy()).add_(1.0)  # x's new memory
            loss.backward()

        if threshold is None:
            body()
            return w.grad, None
        with DTR(
                eviction_threshold=threshold,
                evictee_minimum_size=1) as engine:
            body()
        return w.grad, engine.stats

    grad_ref, _ = run(None)
    grad, stats = run(threshold=1)
    assert torch.equal(grad, grad_ref) and stats.recomputations > 0


def _worker_batch(n):
    """A tensor in shared memory, as a DataLoader worker's batch is: not
    resizable, held by recipes (R14)."""
    storage = torch.UntypedStorage._new_shared(4 * n)
    return torch.tensor([], dtype=torch.float32).set_(storage).fill_(1.0)


def test_an_op_reading_numpys_memory_is_kept():
    """Found by an adversarial search: a target buffer refilled by NumPy
    for each image, never seen by the dispatcher; a rebuild of an earlier
    image's activation read the later targets."""
    w0 = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    feats = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1))
    targets = [
        np.random.RandomState(i).rand(64, 32).astype(np.float32)
        for i in range(4)
    ]

    def run(threshold):
        w = w0.clone().requires_grad_()
        buffer = np.empty((64, 32), np.float32)
        t = torch.from_numpy(buffer)

        def body(x, w):
            loss = 0
            for i in range(4):
                buffer[...] = targets[i]  # outside the dispatcher
                loss = loss + ((t * 2.0).sigmoid() * (feats[i] @ w)).sum()
            loss.backward()

        return _grad(body, None, w, threshold)

    grad_ref, _ = run(None)
    grad, stats = run(threshold=1)
    assert torch.equal(grad, grad_ref) and stats.evictions > 0


def test_a_write_to_a_sparse_tensor_writes_the_storage_it_shares():
    """Found by an adversarial search: ``sparse_coo_tensor(i, v)`` shares
    ``v``'s memory, which a sparse ``div_`` writes; the write was not seen
    and a rebuild read the new values."""
    x, w = _inputs()

    def body(x, w):
        h = x @ w  # recorded
        loss = h.exp().sum()  # saves exp(h); its recipe reads h
        sparse = torch.sparse_coo_tensor(
            torch.arange(128)[None],
            h.detach().view(-1), (128, ),
            is_coalesced=True)
        sparse.div_(2.0)  # h's storage
        torch.ones(2**16).sum()  # memory rises: exp(h) is evicted here
        loss.backward()

    grad_ref, _ = _grad(body, x, w, None)
    grad, stats = _grad(body, x, w, threshold=1)
    assert torch.equal(grad, grad_ref) and stats.evictions > 0


def test_address_index():
    index = AddressIndex()  # aliases of one array overlap
    for start, end, cdata in ((100, 150, 1), (0, 1000, 2), (300, 350, 3),
                              (10, 20, 4)):
        index.add(start, end, cdata)
    assert sorted(index.overlapping(120, 121)) == [1, 2]
    assert sorted(index.overlapping(140, 320)) == [1, 2, 3]
    assert index.overlapping(1000, 1100) == []  # ends are exclusive
    index.remove(0, 2)
    assert index.overlapping(30, 40) == [] and len(index) == 3


def test_the_index_follows_the_storages():
    x, w = _inputs()
    with DTR(eviction_threshold='1GB') as engine:
        state = engine._state
        h = x @ w  # its recipe holds x and w: resizable, not indexed
        assert not state.foreign_index
        other = _worker_batch(16)
        y = other * w[0]  # held from outside, not resizable
        indexed = {c for i in state.foreign_index.values() for c in i.cdatas}
        assert indexed == {other.untyped_storage()._cdata}
        del h, y, other  # freed: out of the index
        assert not state.foreign_index


def test_parameters_torch_made_not_resizable_still_evict():
    """Found by a review: ``.numpy()`` of a parameter (a histogram in a
    logger) and ``load_state_dict(assign=True)`` make its storage not
    resizable; every op reading it then got no recipe."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))

    def evictions():
        model.zero_grad(set_to_none=True)
        with DTR(eviction_threshold=50_000, evictee_minimum_size=1) as e:
            model(x).square().sum().backward()
        return e.stats.evictions

    fresh = evictions()
    for p in model.parameters():
        np.asarray(p.detach())
    assert not model[0].weight.untyped_storage().resizable()
    assert evictions() == fresh > 0
