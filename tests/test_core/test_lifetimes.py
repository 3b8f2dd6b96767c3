"""Lifetimes (R10): nothing the engine keeps grows across iterations,
whether each iteration has its own scope or one scope spans them all
(``dtr.enable()``)."""
import gc
import weakref
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn as nn

from mmdtr.dtr import DTR


def test_records_do_not_grow_across_iterations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(128, 64)
    sizes, lengths = [], []
    with DTR(eviction_threshold=1, evictee_minimum_size=1) as engine:
        for _ in range(12):
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            state = engine._state
            users = [users for users, _ in state.external_users.values()]
            sizes.append((len(state.records), len(state.candidates),
                          sum(len(u.live()) for u in users)))
            lengths.append(max(len(u) for u in users))
    assert len(set(sizes[1:])) == 1, sizes
    assert sizes[-1][1] == 0
    # dead users' references are pruned: the lists stay short
    assert max(lengths) <= 2 * max(8, max(s[2] for s in sizes)), lengths


def test_graph_dropped_without_backward_is_freed():
    # a head whose output is only logged: its graph is dropped without
    # backward. Saved tensors the engine does not manage (smaller than the
    # minimum size here) must not close a cycle through C++ (R10)
    torch.manual_seed(0)
    body, aux = nn.Linear(64, 64), nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(32, 64)

    def live_tensors():
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    counts = []
    for _ in range(6):
        with DTR(eviction_threshold='1GB'):
            h = body(x).relu()
            logged = aux(h).sigmoid().mean().item()  # noqa: F841
            h.square().mean().backward()
            del h
        body.zero_grad(set_to_none=True)
        counts.append(live_tensors())
    assert counts[2] == counts[-1], counts


def test_state_carried_through_one_long_scope_is_freed():
    # an EMA centre computed in grad mode and carried across iterations,
    # with optimizer steps in the scope: the frozen records' recipes chained
    # every iteration's inputs together until the scope ended (R7, R10)
    torch.manual_seed(0)
    model, head = nn.Linear(32, 32), nn.Linear(32, 1)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01)
    inputs, centre = [], None
    batches = [torch.randn(8, 16, 32) for _ in range(6)]  # a data loader's
    with DTR(eviction_threshold='1MB', evictee_minimum_size=1):
        for _ in range(6):
            x = batches.pop(0)
            inputs.append(weakref.ref(x))
            h = model(x)
            c = torch.zeros(32) if centre is None else centre
            centre = c * 0.9 + h.detach().mean((0, 1)) * 0.1
            loss = head(h - centre).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            del x, h, loss
            gc.collect()
        assert sum(r() is not None for r in inputs) == 0


def test_frozen_records_go_with_their_saved_tensors():
    # MoCo's queue: a clone of it is saved, then the queue is written
    # before backward, so the clone is frozen (R7); it was kept, and
    # metered, until the scope ended
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    queue = torch.randn(64, 512)  # a buffer made before the scope
    clones, in_use = [], []
    with DTR(eviction_threshold='1GB', evictee_minimum_size=1) as engine:
        for _ in range(4):
            q = torch.randn(32, 64) @ w
            neg = queue.clone()
            clones.append(weakref.ref(neg.untyped_storage()))
            loss = (q @ neg).logsumexp(1).mean()  # mm saves the clone
            with torch.no_grad():
                queue[:, :32] = q.T  # enqueue before backward
            loss.backward()
            w.grad = None
            del q, neg, loss
            gc.collect()
            in_use.append(engine._state.in_use)
        assert sum(r() is not None for r in clones) == 0
    assert len(set(in_use)) == 1, in_use


def test_state_carried_out_of_place_keeps_no_old_inputs():
    # a running mean of the data, carried out of place in grad mode, its
    # recipe reading no parameter an optimizer writes: each iteration's
    # recipe read the last one's, and every batch stayed alive (R10)
    def train(scope):
        torch.manual_seed(0)
        head = nn.Linear(64, 1)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        batches = [torch.randn(16, 64) for _ in range(8)]
        alive, centre, losses = [], torch.zeros(64), []
        with scope:
            for _ in range(8):
                x = batches.pop(0)
                alive.append(weakref.ref(x))
                centre = centre * 0.9 + x.mean(0) * 0.1
                loss = head(x - centre).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                del x, loss
                gc.collect()
            # the last batch may stay: the latest centre's recipe reads it
            kept = sum(r() is not None for r in alive)
        return kept, losses, centre, [p.detach() for p in head.parameters()]

    kept, *eager = train(nullcontext())
    assert kept == 0
    kept, *under_dtr = train(DTR(eviction_threshold=1, evictee_minimum_size=1))
    assert kept <= 1
    for a, b in zip(eager, under_dtr):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) \
            if isinstance(a, list) else torch.equal(a, b)


@pytest.mark.parametrize('sweep', ['near', 'far'])
def test_carried_state_cut_while_a_recipe_is_built(same_under_dtr, sweep):
    # the recipe of x + a refers to x, then a's check drops the recipes of
    # a and all that reads it, x's included: the recipe must hold x itself
    # (it was left referring to a record that could not be rebuilt). With
    # a long saved graph alive the next sweep (R10) is hundreds of ops
    # away, so the cut, not the sweep, drops the recipes (found by
    # mutation testing: the near case passed without the rebuilt recipe)
    w = torch.randn(32, 32, requires_grad=True)
    v = torch.randn(16, requires_grad=True)

    def step():
        w.grad = None
        c = v * 1.0
        for _ in range(300 if sweep == 'far' else 0):
            c = c.sin()  # saves c: records with handles, checked per sweep
        a = torch.randn(32, 32) * 1.0
        x = a * 2.0
        g = (x * w).sum()  # saves x: a handle
        (torch.randn(32, 32) @ w).sum().backward()  # a, x now carried
        x.cos()  # x checked: kept for its handle
        del g  # the graph goes without a backward
        y = (x + a) @ w  # x's reference first, then a's check
        del x
        torch.randn(64, 64).exp()  # evicts x + a
        y.sum().backward()
        del c
        return [w.grad]

    assert same_under_dtr(step).recomputations > 0


@pytest.fixture
def walk_steps(monkeypatch):
    """A context manager counting, in a list of one, the records whose
    users the engine's walks look up inside it (R1: counted, not timed)."""
    from mmdtr.core.records import StorageRecord
    live_users, steps = StorageRecord.live_users, [0]

    def counted(rec):
        steps[0] += 1
        return live_users(rec)

    @contextmanager
    def counting():
        monkeypatch.setattr(StorageRecord, 'live_users', counted)
        try:
            yield steps
        finally:
            monkeypatch.setattr(StorageRecord, 'live_users', live_users)

    return counting


@pytest.mark.parametrize('case', ['read_after_backward', 'frozen'])
def test_walks_over_a_chain_are_linear(walk_steps, case):
    # a chain of N records with one saved tensor at its end: reading all of
    # them after a backward (carried-state checks, R10), or writing what
    # they read (R7's freeze), walked the chain once per record, N^2 steps
    # inside one op (review finding). Counted, not timed
    n = 400
    w = torch.randn(8, requires_grad=True)
    queue = torch.ones(8)  # made before the scope
    with DTR(eviction_threshold='1GB', evictee_minimum_size=1):
        xs = [queue * 1.0 + w]
        for _ in range(n):
            xs.append(xs[-1] + 1.0)  # saves nothing
        loss = (xs[-1] * w).sum()  # the one saved tensor
        with walk_steps() as steps:
            if case == 'read_after_backward':
                w.sin().sum().backward()
                torch.stack(xs)
            else:
                with torch.no_grad():
                    queue.add_(1.0)
        loss.backward()
    assert steps[0] < 4 * n, steps


def test_sweep_walks_are_linear(walk_steps):
    # N records, each saved a step or two away, all also read into one
    # chain of N ops that save nothing: a depth-first walk from each went
    # down the chain before finding its handle, N^2 steps per sweep (R10;
    # review finding, 2000: 1.4 s). Counted, not timed
    n = 300
    with DTR(eviction_threshold='1GB', evictee_minimum_size=1) as engine:
        w = torch.randn(4, requires_grad=True)
        xs = [w * i for i in range(n)]
        saved = [(x * 1.5).exp() for x in xs]  # a handle two steps away
        c = torch.stack(xs).sum(0)
        for _ in range(n):
            c = c + 1.0
        with walk_steps() as steps:
            for _ in range(2):  # a record made since backward: 2nd sweep
                (w * 2).exp()  # a graph dropped: a sweep at the next op
                engine._state.sweep_at = 0
                torch.zeros(1)
        del saved
    assert steps[0] < 20 * n, steps


def test_model_built_in_scope_does_not_keep_every_step():
    # parameters allocated in scope are records; each optimizer step wrote
    # them with a replayable op and kept its gradient (R5)
    def live_bytes():
        gc.collect()
        return sum(o.untyped_storage().nbytes() for o in gc.get_objects()
                   if isinstance(o, torch.Tensor))

    sizes = []
    with DTR(eviction_threshold='1GB'):
        torch.manual_seed(0)
        model = nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(8, 256)
        for _ in range(6):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
            sizes.append(live_bytes())
    assert sizes[2] == sizes[-1], sizes


def test_state_written_in_place_each_iteration_keeps_no_inputs():
    # an EMA centre updated in place, in one long scope: its mutation log
    # grew by each update and its recipe kept every iteration's batch (R5)
    torch.manual_seed(0)
    backbone = nn.Linear(32, 32).requires_grad_(False)
    head = nn.Linear(32, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    inputs, centre = [], None
    batches = [torch.randn(8, 16, 32) for _ in range(20)]
    with DTR(eviction_threshold='1MB', evictee_minimum_size=1):
        for _ in range(20):
            x = batches.pop(0)
            inputs.append(weakref.ref(x))
            h = backbone(x)
            feat = h.detach().mean((0, 1))
            if centre is None:
                centre = feat.clone()
            else:
                centre.mul_(0.9).add_(feat, alpha=0.1)
            loss = head(h - centre).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            del x, h, feat, loss
            gc.collect()
        assert sum(r() is not None for r in inputs) <= 1


def _mlp():
    torch.manual_seed(0)  # its ReLU saves a recorded storage: a handle
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


@pytest.mark.parametrize('keep', ['sum_in_place', 'total', 'list'])
def test_kept_outputs_without_backward_hold_no_batch(keep):
    # one long scope, grad mode, no backward: a sum or list of detached
    # outputs kept every iteration's recipe, each holding its batch (made
    # under no_grad); the sweep after the graph's release drops them (R10)
    net = _mlp()
    refs, kept = [], []
    with DTR(eviction_threshold=1, evictee_minimum_size=1):
        for _ in range(12):
            with torch.no_grad():
                b = torch.randn(16, 64)
            refs.append(weakref.ref(b.untyped_storage()))
            out = net(b).detach()
            if keep == 'list':
                kept.append(out.clone())
            elif not kept:
                kept.append(out.clone())
            elif keep == 'sum_in_place':
                kept[0].add_(out)
            else:
                kept[0] = kept[0] + out
            del b, out
        gc.collect()
        assert sum(r() is not None for r in refs) <= 2  # the latest two


# below the default evictee_minimum_size nothing is saved through a handle:
# no release moved the sweep, and every iteration was kept (found by a
# review of long runs)
_HANDLES = pytest.mark.parametrize(
    'min_size', [1, 2**20], ids=['handles', 'no_handle'])


@_HANDLES
def test_saliency_maps_hold_no_gradient(min_size):
    # autograd.grad each iteration, no optimizer: a summary of the input's
    # gradient kept the whole gradient through its recipe (R10)
    net = _mlp()
    refs, kept = [], []
    with DTR(eviction_threshold=1, evictee_minimum_size=min_size):
        for _ in range(12):
            x = torch.randn(16, 64, requires_grad=True)
            (g, ) = torch.autograd.grad(net(x).max(1).values.sum(), x)
            refs.append(weakref.ref(g.untyped_storage()))
            kept.append(g.abs().amax(1))
            del x, g
        gc.collect()
        assert sum(r() is not None for r in refs) <= 2  # the latest two


@_HANDLES
def test_loss_history_holds_no_batch(min_size):
    # backward each iteration, no optimizer step (gradient statistics): a
    # history of detached losses kept each loss's recipe and its batch
    net = _mlp()
    refs, losses = [], []
    with DTR(eviction_threshold='64MB', evictee_minimum_size=min_size):
        for _ in range(12):
            with torch.no_grad():
                x = torch.randn(32, 64)
            refs.append(weakref.ref(x.untyped_storage()))
            loss = net(x).square().mean()
            net.zero_grad(set_to_none=True)
            loss.backward()
            losses.append(loss.detach())
            del x, loss
        gc.collect()
        assert sum(r() is not None for r in refs) <= 2  # the latest two


@pytest.mark.parametrize('read', [False, True])
def test_saved_tensor_read_in_forward_keeps_recipes(read):
    # a Python read of a saved tensor unpacks it outside backward: no sweep
    # follows, so the activation made before the read and saved after it
    # keeps its recipe and is evicted (R10)
    x, w = torch.randn(1024, 1024), torch.randn(1024, requires_grad=True)

    def forward():
        a = x.exp()  # 4 MiB, saved by the mul
        s = w.sigmoid()
        if read:
            assert s.grad_fn._saved_result is not None
        return (a * w).sum()

    with DTR(eviction_threshold=1) as engine:
        forward().backward()
    assert engine.stats.evictions == 1


def test_auxiliary_loss_read_mid_forward_keeps_no_skip():
    # a graph dropped mid-forward (an auxiliary loss read with .item())
    # sweeps: the skips, made by ops that save nothing, lost their recipes,
    # and the later cat's recipe held them through backward (R10)
    torch.manual_seed(0)
    e1, e2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
    d1, aux = nn.Conv2d(16, 8, 3, padding=1), nn.Linear(8, 4)
    x = torch.randn(4, 3, 16, 16)

    def forward(with_aux):
        a = e1(x).relu()
        skip = a * 0.5  # saves nothing
        b = e2(a).relu()
        if with_aux:
            aux(b.mean((2, 3))).square().mean().item()
        return d1(torch.cat([b, skip], 1)).square().mean()

    def peak(with_aux):
        with DTR(eviction_threshold='1GB', evictee_minimum_size=1) as engine:
            for _ in range(2):
                forward(with_aux).backward()
        return engine.stats.peak_memory

    skip_bytes = 4 * 8 * 16 * 16 * 4
    assert peak(True) < peak(False) + skip_bytes, (peak(True), peak(False))
