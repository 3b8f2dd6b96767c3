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

    step = _forward_then_backward(forward, w)
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

    refused_like_eager(_forward_then_backward(forward, w))


def _forward_then_backward(forward, w):
    """A step for the fixtures: ``forward()`` hides what it makes, so the
    smallest threshold evicts it before backward."""

    def step():
        w.grad = None
        out = forward()
        torch.randn(64, 64).exp()
        out.sum().backward()
        return [w.grad]

    return step


@pytest.mark.parametrize('case', ['matmul_3d', 'detach', 'foreach'])
def test_write_through_a_shared_counter_is_refused(refused_like_eager, case):
    # the saved view's counter moved: refused at any threshold. A 3-D
    # matmul's output comes from _unsafe_view, which made the engine fall
    # back to asking which elements were written; a foreach write moves no
    # counter below a dispatch mode unless the engine bumps it as eager does
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(2, 3, 8)

    def forward():
        y = x @ w
        z = y[..., :4].sin()  # saves a slice of y
        if case == 'matmul_3d':
            y[..., 4:].relu_()
        elif case == 'detach':
            y.detach()[..., 4:].mul_(2)
        else:
            torch._foreach_mul_([y[..., 4:]], 2.0)
        return z

    refused_like_eager(_forward_then_backward(forward, w))


@pytest.mark.parametrize(
    'case',
    ['unsafe_chunk', 'unsafe_view', 'set_alias', 'set_twice', 'resize_same'])
def test_write_through_a_counter_of_its_own_is_used(same_under_dtr, case):
    # an alias with a version counter of its own (or a write that moves no
    # counter) leaves the saved tensor's counter as it was: eager reads the
    # new values without a word, and so must the engine, rebuilt or not
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def forward():
        g = x @ w
        z = g.sin()  # saves g
        with torch.no_grad():
            if case == 'unsafe_chunk':
                g.unsafe_chunk(2, 1)[0].detach().mul_(2)
            elif case == 'unsafe_view':
                torch.ops.aten._unsafe_view(g.detach(), [32]).mul_(2)
            elif case == 'set_alias':
                t = torch.empty(0)
                t.set_(g.detach())
                t.mul_(2)
            elif case == 'set_twice':
                t = torch.empty(0)
                t.set_(g.detach())
                t.set_(torch.randn(3))
            else:
                g.detach().resize_(4, 8)  # the same size: no new version
        return z

    stats = same_under_dtr(_forward_then_backward(forward, w))
    # resize_ is never replayed: g's current version is kept resident
    assert stats.evictions > 0 or case == 'resize_same'


def test_foreach_bumps_each_element_as_eager(same_under_dtr):
    # eager bumps a counter once per list element (a tensor listed twice,
    # two views of one base); the engine bumped each counter once at most
    def step():
        a, b = torch.randn(4), torch.randn(4)
        torch._foreach_add_([a, a], 1.0)
        torch._foreach_mul_([b[:2], b[2:]], 2.0)
        with torch.inference_mode():  # no counters: nothing to bump
            c = torch.randn(3)
            torch._foreach_add_([c, c], 1.0)
        return [torch.tensor([a._version, b._version]), a, b, c]

    same_under_dtr(step)


@pytest.mark.parametrize('op', ['index_add_', 'scatter_'])
def test_write_that_fails_half_way_is_never_replayed(same_under_dtr, op):
    # an in-place op that raised after writing some rows: eager's backward
    # reads the rows written; a rebuild replayed the recipe without them
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def forward():
        h = x @ w
        y = h.sin()  # saves h
        with torch.no_grad(), pytest.raises((RuntimeError, IndexError)):
            if op == 'index_add_':
                h.detach().index_add_(0, torch.tensor([0, 1, 9]),
                                      torch.ones(3, 8))
            else:
                h.detach().scatter_(0, torch.tensor([[0] * 8, [9] * 8]),
                                    torch.ones(2, 8))
        return y

    same_under_dtr(_forward_then_backward(forward, w))


@pytest.mark.parametrize('first', ['tensor', 'data'])
def test_two_counters_saved_with_one_view(same_under_dtr, first):
    # a tensor and its .data (a counter of its own, at another version)
    # saved with the same view share the engine's alias; each is checked
    # against its own counter while it lives (one was checked against the
    # other's and refused with nothing written)
    w = torch.randn(8, 8, requires_grad=True)
    v = torch.randn(4, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def step():
        w.grad = v.grad = None
        a = x @ w
        a.mul_(2)  # a at version 1, a.data at version 0
        b = a.data
        if first == 'tensor':
            y1, y2 = a.sin(), b * v
        else:
            y2, y1 = b * v, a.sin()
        (y1.sum() + y2.sum()).backward()
        return [w.grad, v.grad]

    same_under_dtr(step)


def test_saved_output_detached_in_place_is_used_as_eager(same_under_dtr):
    # eager refuses a saved input detached in place, not a saved output
    # (its node gives it its grad_fn back); the engine checked neither
    # before and must not refuse the output now
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def step():
        w.grad = None
        e = (x @ w).exp()  # saves its output
        z = e * 2
        e.detach_()
        z.sum().backward()
        return [w.grad]

    same_under_dtr(step)


class _Forwarding(torch.Tensor):
    """A subclass whose ops run on plain data (the engine's subclass path).
    """

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with torch._C._DisableTorchDispatch():
            return func(*args, **(kwargs or {}))


def test_half_done_write_with_a_subclass_argument(same_under_dtr):
    # the subclass path ran the op with no handler: rows written before
    # the error were lost to a rebuild
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def forward():
        h = x @ w
        y = h.sin()  # saves h
        source = torch.ones(3, 8).as_subclass(_Forwarding)
        with torch.no_grad(), pytest.raises((RuntimeError, IndexError)):
            h.detach().index_add_(0, torch.tensor([0, 1, 9]), source)
        return y

    same_under_dtr(_forward_then_backward(forward, w))


def test_foreach_on_wrapper_subclasses_bumps_nothing():
    # eager does not bump the counters of wrapper subclasses in a foreach
    # list; the engine bumped them
    from torch.testing._internal.two_tensor import TwoTensor
    versions = []
    for under_dtr in (False, True):
        a = TwoTensor(torch.randn(3), torch.randn(3))
        with DTR(eviction_threshold='1GB') if under_dtr \
                else torch.enable_grad():
            torch._foreach_add_([a, a], 1.0)
        versions.append(a._version)
    assert versions[0] == versions[1]
