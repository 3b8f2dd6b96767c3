"""Autograd's in-place check, kept under DTR (R10).

Saved-tensor hooks turn autograd's version check off; the engine does it:
it refuses what eager refuses (``refused_like_eager``), lets through what
eager lets through (``same_under_dtr``), at any threshold, and never hands
out an old value. Each case failed on an engine before its fix.
"""
import pytest
import torch
import torch.nn as nn

from mmdtr.dtr import DTR


def forward_then_backward(forward, w):
    """A step for the fixtures: ``forward()`` hides what it makes, so the
    smallest threshold evicts it before backward."""

    def step():
        w.grad = None
        out = forward()
        torch.randn(64, 64).exp()
        out.sum().backward()
        return [w.grad]

    return step


@pytest.mark.parametrize('written', ['parameter', 'activation'])
def test_saved_tensor_written_before_backward_raises(written):
    # saved-tensor hooks turn autograd's version check off; the engine does
    # it instead, at any threshold
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    with DTR(eviction_threshold=2**40, evictee_minimum_size=1):
        if written == 'parameter':  # optimizer.step() before backward()
            y = (x * w).sum()  # mul saves w
            with torch.no_grad():
                w.add_(1.0)
        else:
            a = x.mm(w)
            y = a.sin().sum()  # sin saves a
            a.mul_(2)
        with pytest.raises(RuntimeError, match='modified by an inplace'):
            y.backward()


def test_write_through_data_is_used_as_eager_uses_it(same_under_dtr):
    # .data has a version counter of its own: eager raises nothing and
    # backward reads the written values; rebuilt, they are replayed (the
    # engine used to refuse it, unable to tell .data from a view)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)

    def forward():
        a = x @ w
        y = a.sin()  # saves a
        a.data.mul_(2)
        return y

    step = forward_then_backward(forward, w)
    assert same_under_dtr(step).recomputations > 0


@pytest.mark.parametrize('cell', ['GRU', 'GRUCell', 'LSTMCell', 'LSTM_proj'])
def test_rnn_cells_writing_chunks_of_one_storage(same_under_dtr, cell):
    # ATen's cells split the gates with unsafe_chunk (own version counters)
    # and write each chunk in place next to a saved sibling: autograd's
    # check passes in eager; the engine's per-storage versions must not
    # call it a conflict (R10)
    torch.manual_seed(0)
    module = dict(
        GRU=lambda: nn.GRU(8, 4, batch_first=True),
        GRUCell=lambda: nn.GRUCell(8, 4),
        LSTMCell=lambda: nn.LSTMCell(8, 4),
        LSTM_proj=lambda: nn.LSTM(8, 4, batch_first=True, proj_size=2))[cell]()
    x = torch.randn(3, 5, 8)

    def step():
        module.zero_grad()
        if cell.endswith('Cell'):
            h = None
            for t in range(x.shape[1]):
                h = module(x[:, t], h)
            out = h[0] if isinstance(h, tuple) else h
        else:
            out = module(x)[0]
        loss = out.sum()
        loss.backward()
        return [loss, *(p.grad for p in module.parameters())]

    assert same_under_dtr(step).recomputations > 0


def test_running_stats_made_in_scope(same_under_dtr):
    # the stats are recorded storages (made by an op in scope); batch norm
    # writes them without a declared write, so autograd's version of the
    # saved stats does not move and eager never complains (R10)
    def step():
        norm = nn.InstanceNorm1d(4, track_running_stats=True, affine=True)
        bn = nn.BatchNorm1d(4)  # reset_running_stats: zero_() in scope
        x = torch.randn(3, 4, 6, requires_grad=True)
        loss = (bn(norm(x).exp()).sin() * 1.5).sum()
        loss.backward()
        return [
            loss, x.grad, norm.running_mean, bn.running_var,
            *(p.grad for p in [*norm.parameters(), *bn.parameters()])
        ]

    assert same_under_dtr(step).recomputations > 0


def test_write_over_a_saved_chunk_still_refused(refused_like_eager):
    # the check stays for the elements saved: a write through the chunk
    # itself after it was saved is an error, as in eager
    w = torch.randn(4, 6, requires_grad=True)

    def step():
        a, b = (w * 1.0).unsafe_chunk(2, 1)
        s = a.sigmoid()  # saves its result (a new storage)
        s.mul_(2)
        s.sum().backward()

    refused_like_eager(step)


@pytest.mark.fails_before_torch(
    (2, 5),
    reason='PyTorch 2.4 hands out a rebuilt saved tensor with a '
    'version counter of its own: a write through it is not refused')
@pytest.mark.parametrize('reads', [1, 3])
def test_write_through_a_rebuilt_saved_tensor_is_refused(
        refused_like_eager, reads):
    # an unpack after an eviction hands out a rebuilt tensor with a counter
    # of its own; eager's shares the saved one's, and a write through it is
    # refused at backward (R10). The engine used to run backward on the
    # written values
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)

    def step():
        y = (x @ w).sin().cos()  # cos saves sin's output
        saved = None
        for _ in range(reads):  # each read rebuilds it (threshold 1)
            del saved
            x.mul(1.0)  # an op: the engine evicts it
            saved = y.grad_fn._saved_self
        saved.add_(1.0)
        del saved
        y.sum().backward()

    refused_like_eager(step)


@pytest.mark.fails_before_torch(
    (2, 5),
    reason='PyTorch 2.4 hands out a rebuilt saved tensor with a '
    'version counter of its own: a write through it is not refused')
def test_saved_byte_tensor_over_a_whole_rebuilt_storage(refused_like_eager):
    # a 1-D uint8 tensor over a whole storage has the meta of the alias
    # the engine keeps of a storage it rebuilt: it was handed out as it,
    # and a write through it was not refused (review finding)
    w = torch.randn(64, requires_grad=True)

    def step():
        m = (torch.rand(64) > 0.5).to(torch.uint8)
        y = w * m  # saves m
        z = w * m.float()  # saves m.float(), rebuilt from m
        del m
        torch.randn(256).mul(1.0)  # evicts
        z.grad_fn._saved_other  # rebuilds m.float(), and m with it
        saved = y.grad_fn._saved_other
        saved.add_(1)
        del saved
        y.sum().backward()

    refused_like_eager(step)


def test_rebuilt_saved_tensor_read_before_backward(same_under_dtr):
    # reading it (no write) changes nothing: backward as in eager
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)

    def step():
        w.grad = None
        y = (x @ w).sin().cos()
        for _ in range(3):
            x.mul(1.0)
            total = y.grad_fn._saved_self.sum()
        y.sum().backward()
        return [w.grad, total]

    assert same_under_dtr(step).recomputations > 0


def test_foreach_write_to_a_saved_tensor_is_refused(refused_like_eager):
    # foreach ops return nothing, but eager versions their list writes:
    # the engine's check must see them (R10)
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        h = x.exp()
        y = h.sin()  # saves h
        torch._foreach_add_([h], 1.0)
        y.sum().backward()

    refused_like_eager(step)


def test_fused_step_on_a_saved_weight_made_in_scope(same_under_dtr):
    # fused optimizer steps write their lists without bumping versions:
    # eager raises nothing, so neither may the engine's check (R10)
    def step():
        w = torch.randn(16, 16, requires_grad=True)  # made in scope
        x = torch.randn(8, 16, requires_grad=True)
        loss = (x @ w).sum()  # saves w, for x's gradient
        opt = torch.optim.SGD([w], lr=0.1, fused=True)
        loss.backward(retain_graph=True)
        opt.step()
        loss.backward()
        return [loss, w, w.grad, x.grad]

    same_under_dtr(step)


def test_write_beside_a_saved_view_is_refused(refused_like_eager):
    # views share their base's version counter: eager refuses a write to
    # the other half too. The engine did only while the storage stayed
    # resident; evicted, it asked whether the saved elements were touched,
    # a question only for aliases with counters of their own (R10)
    w = torch.randn(6, 8, requires_grad=True)
    v = torch.randn(6, 4, requires_grad=True)

    def forward():
        base = w * 2
        y = base[:, :4] * v  # saves the view base[:, :4]
        base[:, 4:].mul_(3)
        return y  # base is no longer visible: evictable

    refused_like_eager(forward_then_backward(forward, w))
