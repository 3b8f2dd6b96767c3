"""Ops and writes at the edges of the engine (R4, R5, R7, R10; the tensor
kinds are in test_tensor_kinds.py, writes through subclasses in
test_subclass_writes.py).

Each case runs a step without DTR and under the smallest threshold, and
compares every returned tensor bit for bit (the ``same_under_dtr`` fixture).
Found by an adversarial search or a scan; each failed before its fix, but
for the ctc_loss case, which records what already held.
"""

import os

import pytest
import torch
import torch.nn as nn

from mmdtr.dtr import DTR


def test_op_writing_two_out_tensors(same_under_dtr):
    # max(out=(values, indices)): one call writes two storages, and no
    # single recipe can rebuild either of them
    w = torch.randn(16, 16, requires_grad=True)

    def step():
        w.grad = None
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        values, indices = y.amax(1) * 1.0, y.argmax(1) + 0
        torch.max(y * 2, 1, out=(values, indices))
        picked = torch.gather(x @ w, 1, indices.unsqueeze(1))  # saves them
        del values, indices  # now only the engine holds them
        torch.randn(64, 64).sum()  # one more op: they are evicted
        loss = picked.exp().sum()
        loss.backward()
        return [loss, w.grad]

    assert same_under_dtr(step).evictions > 0


def test_positional_generator_is_replayed(same_under_dtr):
    # poisson's Generator is positional in its schema. Two draws: a replay
    # of the first that left gen at its recorded state shifted gen's stream,
    # where with one draw it happened to end where eager's does (found by
    # mutation testing, R6)
    x = torch.randn(8, 16, requires_grad=True)

    def step():
        x.grad = None
        gen = torch.Generator().manual_seed(3)
        counts = torch.poisson(torch.full((8, 16), 3.0), generator=gen)
        more = torch.poisson(torch.full((8, 16), 2.0), generator=gen)
        h = (x * counts).exp().sin() * more  # counts rebuilt last
        del counts, more  # now only the engine holds them
        loss = h.sum()
        loss.backward()
        return [loss, x.grad, gen.get_state()]

    assert same_under_dtr(step).recomputations > 0


def test_lstm_workspace_is_rebuilt_in_grad_mode(same_under_dtr):
    # mkldnn_rnn_layer returns its workspace only in grad mode
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16)
    x = torch.randn(5, 3, 8)

    def step():
        lstm.zero_grad()
        loss = lstm(x)[0].exp().sin().sum()
        loss.backward()
        return [loss] + [p.grad for p in lstm.parameters()]

    assert same_under_dtr(step).recomputations > 0


def test_backward_under_autocast_replays_the_recorded_dtypes(same_under_dtr):
    # a gradient penalty's autograd.grad inside autocast: the recorded ops
    # are already cast, so a replay must not cast them again
    x = torch.randn(8, 16)
    w = torch.randn(16, 16, requires_grad=True)

    def step():
        loss = torch.tanh(torch.tanh(x @ w).sin() @ w).sum()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            grad, = torch.autograd.grad(loss, w)
        return [loss, grad]

    assert same_under_dtr(step).recomputations > 0


def test_batch_norm_without_running_statistics(same_under_dtr):
    x = torch.randn(4, 3, 5, 5, requires_grad=True)

    def step():
        x.grad = None
        out = torch.ops.aten._native_batch_norm_legit(x, None, None, True, 0.1,
                                                      1e-5)[0]
        loss = out.exp().sum()
        loss.backward()
        return [loss, x.grad]

    same_under_dtr(step)


def test_freezing_keeps_older_versions_for_the_readers(same_under_dtr):
    # a's in-place write read an external leaf; writing that leaf freezes a
    # and its readers, and b read a's OLDER version: it must still rebuild
    def setup():
        return (torch.randn(64, 64), torch.randn(64, 64, requires_grad=True),
                torch.randn(64, 64, requires_grad=True))

    def step(made):
        x, w, bias = made
        a = x.mm(w)
        b = a * 2  # reads a at version 0
        c = b.sin()  # saves b
        a.add_(bias)  # a's write reads bias
        d = a.cos()
        del a, b
        e = c.exp()
        with torch.no_grad():
            bias.add_(1)  # legal: nothing saved bias
        (e.sum() + d.sum()).backward()
        return [w.grad]

    assert same_under_dtr(step, setup).recomputations > 0


@pytest.mark.parametrize('case', ['cycle', 'deep'])
def test_freezing_cycles_and_long_chains(same_under_dtr, case):
    # R7 freezes what reads a storage about to be written: an in-place
    # write reading its own storage (logits.sub_(logits.max(...))) makes
    # two records read each other, and a long chain is deeper than
    # Python's stack; both raised RecursionError (review findings)
    w = torch.randn(64, 64, requires_grad=True)

    def step(queue):
        w.grad = None
        q = torch.randn(32, 64) @ w
        if case == 'cycle':
            h = q @ queue.clone()
            h.sub_(h.max(1, keepdim=True)[0].detach())
            loss = h.logsumexp(1).mean()
        else:
            h = q[:, :8] * queue[:8, :32].T.clone()
            for _ in range(1500):
                h = h.sin()
            loss = h.sum()
        with torch.no_grad():
            queue[:, :32] = q.T  # written before backward
        loss.backward()
        return [loss, w.grad]

    same_under_dtr(step, setup=lambda: torch.ones(64, 512))


@pytest.mark.parametrize(
    'make', [
        lambda: torch.randn(16, 16) * 1.0,
        lambda: torch.arange(16 * 16).view(16, 16) * 0.5,
    ],
    ids=['factory', 'promotion'])
def test_replays_read_the_default_dtype_of_the_call(same_under_dtr, make):
    # randn without a dtype, and int * 0.5, take the default dtype of the
    # moment: a replay after the default changed must run under the one of
    # the call (R4)
    w = torch.ones(16, 16, requires_grad=True)

    def step():
        w.grad = None
        default = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float64)
            made = make()  # float64
            y = (w * made.float()).exp()  # saves the float32 copy
            del made
            torch.set_default_dtype(torch.float32)
            loss = (y * torch.arange(16.0)).sum()  # arange: float32 now
            loss.backward()
        finally:
            torch.set_default_dtype(default)
        return [loss, w.grad]

    assert same_under_dtr(step).recomputations > 0


@pytest.mark.parametrize('kind', ['fill_', 'bernoulli_'])
def test_whole_overwrite_that_reads_itself(same_under_dtr, kind):
    # a fresh buffer overwritten whole is rebuilt from an empty one (R5);
    # x.fill_(x[3]) and p.bernoulli_(p) read it through another argument,
    # which a rebuild read as garbage
    w = torch.randn(16, 256, requires_grad=True)

    def step():
        w.grad = None
        if kind == 'fill_':
            s = torch.zeros(256)
            s[3] = 2.5
            s.fill_(s[3])
        else:
            with torch.no_grad():
                s = torch.rand(256)
            s.bernoulli_(s)
        h = w * s  # saves s
        del s
        loss = (h.tanh() * torch.randn(16, 256)).sum()
        loss.backward()
        return [loss, w.grad]

    assert same_under_dtr(step).recomputations > 0


def test_empty_storages_are_not_eviction_candidates():
    # evictee_minimum_size=0 let an empty saved tensor in, and the policy
    # divided by its size
    x = torch.randn(64, 64, requires_grad=True)
    with DTR(eviction_threshold=1, evictee_minimum_size=0) as engine:
        loss = (x[:0] * 2).exp().sum() + (x * 2).exp().sum()  # both saved
        torch.ones(1 << 16).exp()  # makes room: evicts the saved ones
        loss.backward()
    assert engine.stats.evictions > 0


def test_batch_norm_statistics_kernel_updates_running_stats_once(
        same_under_dtr):
    # batch_norm_update_stats writes its running statistics, which its
    # schema does not declare: a replay must not update them again (R6)
    lin = nn.Linear(32, 32)

    def step(stats):
        mean, var = stats
        lin.zero_grad()
        h = lin(torch.randn(64, 32)).tanh()
        # the batch's variance: saved by mul, held by nothing else
        y = h * torch.batch_norm_update_stats(h.detach(), mean, var, 0.1)[1]
        loss = torch.sigmoid(lin(y)).square().sum()
        loss.backward()
        return [loss, lin.weight.grad, mean, var]

    def fresh_stats():
        return torch.zeros(32), torch.ones(32)

    assert same_under_dtr(step, fresh_stats).recomputations > 0


@pytest.mark.parametrize('layout', ['coo', 'csr'])
def test_sparse_input_written_through_its_values(layout, same_under_dtr):
    # a write through values() reaches no storage the engine links (R7):
    # an op reading a sparse tensor gets no recipe, its output is kept
    lin = nn.Linear(32, 32)
    dense = torch.rand(16, 32) * (torch.rand(16, 32) > 0.7)

    def step():
        lin.zero_grad()
        sparse = dense.to_sparse() if layout == 'coo' else \
            dense.to_sparse_csr()
        h = lin(torch.randn(16, 32)).tanh()
        y = torch.sigmoid(lin(h * sparse.to_dense()))
        sparse.values().mul_(2)  # eager allows it: sparse is not saved
        loss = y.square().sum()
        loss.backward()
        return [loss, lin.weight.grad]

    assert same_under_dtr(step).recomputations > 0


def test_from_file_is_not_read_again(same_under_dtr, tmp_path):
    # a rebuild opened the path again: replaced since, it read the new
    # file's bytes (gradients off by 0.71); removed, it raised where eager
    # runs (found by an adversarial search)
    path = str(tmp_path / 'table.bin')
    x = torch.ones(64, requires_grad=True)

    def step():
        x.grad = None
        torch.linspace(0, 1, 64).numpy().tofile(path)
        table = torch.from_file(path, shared=False, size=64)
        h = (table * 2).sin()
        del table
        loss = (h.exp() * x).tanh().sum()
        del h
        torch.full((64, ), 7.0).numpy().tofile(path + '.new')
        os.replace(path + '.new', path)  # a new version, written atomically
        loss.backward()
        return loss.detach(), x.grad

    assert same_under_dtr(step).evictions > 0


def test_lstsq_is_not_computed_again(same_under_dtr):
    # the default CPU driver (gelsy) gives other bits on another call: a
    # rebuilt solution gave the gradient of another loss (found by an
    # adversarial search); checked against the forward's own solution,
    # since eager's runs differ too
    def step():
        a, b = torch.randn(6, 6).tanh(), torch.randn(6, 4)
        c = torch.ones(6, 4, requires_grad=True)
        y = torch.linalg.lstsq(a, b).solution
        y_forward = y.detach().clone()
        loss = (y * c).sum()  # saves y for c's gradient
        del y
        torch.ones(64).sum()  # one more op: y would be evicted
        loss.backward()
        return (c.grad == y_forward).all().unsqueeze(0),

    for _ in range(10):
        same_under_dtr(step)


def test_ctc_loss_with_lengths_is_exact(same_under_dtr):
    # _ctc_loss leaves log_alpha unwritten past each item's lengths: a
    # rebuild's unwritten bytes differ, and its backward must not read them
    # (found by a scan of ops for other bits on a second call)
    logits = torch.randn(12, 3, 6, requires_grad=True)
    targets = torch.randint(1, 6, (3, 5))

    def step():
        logits.grad = None
        log_probs = (logits * 2).sin().log_softmax(2)
        loss = nn.functional.ctc_loss(log_probs, targets, (12, 9, 7),
                                      (5, 3, 2))
        loss.backward()
        return loss.detach(), logits.grad

    assert same_under_dtr(step).recomputations > 0


@pytest.mark.parametrize('then_unsqueeze', [False, True])
def test_no_grad_write_to_a_split_output_after_its_base_was_written(
        same_under_dtr, then_unsqueeze):
    # the engine read the written view's grad_fn, which autograd rebuilds
    # after the base's write and refuses for a view from a multi-output op:
    # a RuntimeError where eager runs (found by a fuzzer)
    p = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def step():
        p.grad = None
        a = p * 1
        v = torch.split(a, 1)[0]
        if then_unsqueeze:
            v = v.unsqueeze(0)
        a.mul_(-2)
        with torch.no_grad():
            v.add_(1.0)
        loss = (a * a).sum()
        loss.backward()
        return loss.detach(), p.grad

    same_under_dtr(step)


def test_read_of_a_split_output_of_an_outside_base_written_since(
        same_under_dtr):
    # the engine read a held input's grad_fn, which autograd refuses to
    # rebuild for such a view; eager runs ops that do not differentiate it
    # (found by a fuzzer)
    def setup():
        p = torch.randn(4, requires_grad=True)
        a = p * 1
        view = torch.split(a, 2)[0]
        a.mul_(-2)
        return view

    def step(view):
        return (view > 0).float().cumsum(0), view.argmax().unsqueeze(0)

    same_under_dtr(step, setup)
