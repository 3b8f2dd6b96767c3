"""Mutation logs (R5): the in-place writes logged to rebuild a storage do
not keep what they read alive for longer than something can ask for it."""
import gc
import weakref
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

from mmdtr.dtr import DTR


def test_state_overwritten_each_iteration_stays_bounded():
    # truncated backpropagation through time: the state is copied over at
    # the end of each iteration; each copy_ kept that iteration's last
    # hidden state (R5). At most MAX_MUTATIONS of them are kept now.
    from mmdtr.core.writes import MAX_MUTATIONS
    torch.manual_seed(0)
    cell, head = nn.GRUCell(16, 16), nn.Linear(16, 1)
    opt = torch.optim.SGD([*cell.parameters(), *head.parameters()], lr=0.01)
    finals, alive = [], []
    with DTR(eviction_threshold='1MB', evictee_minimum_size=1):
        state = torch.zeros(4, 16) * 1.0
        for _ in range(3 * MAX_MUTATIONS):
            x = torch.randn(4, 5, 16)
            h = state.clone()
            for t in range(5):
                h = cell(x[:, t], h)
            loss = head(h).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            finals.append(weakref.ref(h.untyped_storage()))
            state.copy_(h.detach())
            del x, h, loss
            gc.collect()
            alive.append(sum(r() is not None for r in finals))
    assert max(alive) <= MAX_MUTATIONS, alive


def test_state_written_often_before_a_sweep_keeps_few_inputs():
    # a carried state written in place each iteration while the next sweep
    # (R10) is far away (a long saved graph alive): the cap on its log is
    # what drops the inputs; without it each write kept its input alive
    # until that sweep, 40 of 40 here (found by mutation testing, R5)
    from mmdtr.core.writes import MAX_MUTATIONS
    torch.manual_seed(0)
    w = torch.randn(4096, requires_grad=True)
    u, x0 = torch.randn(4096), torch.randn(4096)
    v = torch.randn(16, requires_grad=True)
    batches = [torch.randn(4096) for _ in range(40)]
    alive = []
    with DTR(eviction_threshold='1GB', evictee_minimum_size=1):
        c = v * 1.0
        for _ in range(300):  # records with handles, checked per sweep
            c = c.sin()
        state = x0 * w  # a recipe
        z = (state + u).exp()  # saves its output: a handle reaching state
        (v * v).sum().backward()  # state is made before a backward now
        del z  # its handle goes: a sweep is due, some 300 ops from now
        kept = []  # after each write
        for _ in range(40):
            x = batches.pop(0)
            alive.append(weakref.ref(x))
            state.add_(x + 1)  # logged: the recipe of x + 1 holds x
            del x
            gc.collect()
            kept.append(sum(r() is not None for r in alive))
    # the log holds MAX_MUTATIONS writes, and the next one drops them all
    # (the boundary: a mutant capping at MAX_MUTATIONS + 1 passed before)
    assert kept[:MAX_MUTATIONS + 1] == [*range(1, MAX_MUTATIONS + 1), 0]
    assert max(kept) == MAX_MUTATIONS


def test_activation_written_many_times_in_its_forward_stays_evictable(
        same_under_dtr):
    # the cap on mutation logs is for state carried across iterations: an
    # activation of the running forward written more than MAX_MUTATIONS
    # times before its save was kept resident, saving nothing
    from mmdtr.core.writes import MAX_MUTATIONS
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def forward():
        h = x @ w
        for _ in range(MAX_MUTATIONS + 4):
            h.mul_(1.01).add_(0.1)
        return h.sin()  # saves h, the only storage backward needs

    def step():
        w.grad = None
        y = forward()
        torch.randn(64, 64).exp()  # evicts h at the smallest threshold
        y.sum().backward()
        return [w.grad]

    assert same_under_dtr(step).recomputations > 0


@pytest.mark.parametrize('write', ['add_', 'copy_'])
def test_buffer_written_in_place_keeps_no_source(write):
    # a metric summed under no_grad into a buffer zero_() made rebuildable,
    # and torch.optim.LBFGS's prev_flat_grad.copy_(flat_grad): each write
    # was logged holding its source (made in scope without a recipe), so
    # every step's source stayed alive, without bound without a backward
    sources = []
    with DTR(eviction_threshold=1, evictee_minimum_size=1) as engine:
        with torch.no_grad():
            buf = torch.zeros(4096) if write == 'copy_' else torch.empty(4096)
            if write == 'add_':
                buf.zero_()
        for _ in range(12):
            with torch.no_grad():
                new = torch.randn(4096)
            sources.append(weakref.ref(new.untyped_storage()))
            with torch.no_grad() if write == 'add_' else nullcontext():
                getattr(buf, write)(new)
            del new
        gc.collect()
        assert engine._state.in_use == buf.untyped_storage().nbytes()
    assert all(r() is None for r in sources)


def test_gradients_zeroed_in_place_keep_no_incoming_gradient():
    # zero_grad(set_to_none=False) in one long scope: each accumulation
    # into .grad was logged holding the incoming gradient (a backward
    # output), so several copies of the gradients stayed resident
    torch.manual_seed(0)
    net = nn.Linear(64, 64)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(4, 64)
    grad_bytes = sum(p.untyped_storage().nbytes() for p in net.parameters())
    in_use = []
    with DTR(eviction_threshold=1, evictee_minimum_size=1) as engine:
        for _ in range(6):
            opt.zero_grad(set_to_none=False)
            for _ in range(3):  # micro-batches
                net(x).square().mean().backward()
            opt.step()
            gc.collect()
            in_use.append(engine._state.in_use)
    assert in_use == [grad_bytes] * 6, (in_use, grad_bytes)


def test_activation_written_with_unrecorded_input_is_exact(same_under_dtr):
    # the write reads a mask made under no_grad (no recipe): not logged, so
    # the activation's current version is kept, and what it reads rebuilds
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)

    def forward():
        g = (x @ w).tanh() * 2.0  # tanh saves its output
        with torch.no_grad():
            mask = torch.rand(32, 64) + 0.5  # not 0/1: a wrong g shows
        g.mul_(mask)
        return g.sin()  # saves g after the write

    def step():
        w.grad = None
        y = forward()
        torch.randn(256, 256).exp()  # evicts at the smallest threshold
        y.sum().backward()
        return [w.grad]

    assert same_under_dtr(step).recomputations > 0


def test_scores_masked_in_place_with_an_older_mask_are_freed():
    # attention's scores written in place with a padding mask made before
    # them (a fresh buffer partly written, no recipe): logged as before, so
    # the scores go once softmax ran, as in eager, instead of being kept
    torch.manual_seed(0)
    w = torch.randn(16, 48, requires_grad=True)
    x = torch.randn(2, 8, 16)
    scores = []
    with DTR(eviction_threshold='1GB', evictee_minimum_size=1):
        pad = torch.zeros(2, 8, dtype=torch.bool)
        pad[1, 5:] = True
        for _ in range(3):
            q, k, v = (x @ w).chunk(3, -1)
            sc = q @ k.transpose(-1, -2)
            sc.masked_fill_(pad[:, None, :], float('-inf'))
            scores.append(weakref.ref(sc.untyped_storage()))
            x = x + sc.softmax(-1) @ v  # softmax saves its output only
        del q, k, v, sc
        gc.collect()
        assert all(r() is None for r in scores)
        x.sum().backward()
