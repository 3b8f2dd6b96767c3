"""Ops, tensor kinds and writes at the edges of the engine (R4, R5, R7, R10).

Each case runs a step without DTR and under the smallest threshold, and
compares every returned tensor bit for bit (the ``same_under_dtr`` fixture).
Found by an adversarial search; each failed before its fix.
"""
import pytest
import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError


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
    # poisson's Generator is positional in its schema
    x = torch.randn(8, 16, requires_grad=True)

    def step():
        x.grad = None
        gen = torch.Generator().manual_seed(3)
        counts = torch.poisson(torch.full((8, 16), 3.0), generator=gen)
        h = (x * counts).exp().sin()
        del counts  # now only the engine holds it
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


@pytest.mark.parametrize('bit', ['conj', 'neg'])
def test_views_with_a_conjugate_or_negative_bit_are_held(bit, same_under_dtr):
    x = torch.randn(8, 8, dtype=torch.cfloat)
    w = torch.randn(8, 8, dtype=torch.cfloat, requires_grad=True)

    def step():
        w.grad = None
        h = (x @ w).add(1)
        if bit == 'conj':
            y = (h.conj() @ h).exp().abs()  # mm saves the conj view
        else:
            n = h.conj().imag  # a negative-bit view
            y = (n * n.exp()).sin()
        del h
        loss = y.sum()
        loss.backward()
        return [loss, w.grad]

    same_under_dtr(step)


@pytest.mark.filterwarnings('ignore:torch.quantize_per_tensor')
def test_quantized_tensors_are_held(same_under_dtr):
    x = torch.randn(8, 16)
    w = torch.randn(16, 16, requires_grad=True)

    def step():
        w.grad = None
        h = (x @ w).add(1)
        q = torch.quantize_per_tensor(h.detach(), 0.1, 0, torch.qint8)
        y = (h * q.dequantize()).exp().sin()
        del q, h
        loss = y.sum()
        loss.backward()
        return [loss, w.grad]

    same_under_dtr(step)


def test_sparse_tensors_are_held(same_under_dtr):
    adj = (torch.rand(8, 8) > 0.7).float().to_sparse()  # made outside
    x = torch.randn(8, 16)
    w = torch.randn(16, 16, requires_grad=True)

    def step():
        w.grad = None
        inside = (torch.rand(8, 8) > 0.5).float().to_sparse()
        h = torch.sparse.mm(adj, x @ w).relu()
        h = torch.sparse.mm(inside, h.exp()).sin()
        loss = h.sum()
        loss.backward()
        return [loss, w.grad]

    same_under_dtr(step)


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


class _PassThrough(torch.Tensor):
    """A tensor subclass that runs every op on its plain tensors."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):

        def plain(a):
            if isinstance(a, _PassThrough):
                with torch._C._DisableTorchDispatch():
                    return a.as_subclass(torch.Tensor)
            return a

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def test_write_through_a_subclass_is_seen(same_under_dtr):

    def setup():
        return torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)

    def step(made):
        x, w = made
        h = x @ w
        b = h * 3  # reads h at version 0
        c = b.sin()  # saves b
        with torch.no_grad():
            h.as_subclass(_PassThrough).add_(1)
        del b
        (c.exp() + h.sum()).sum().backward()
        return [w.grad]

    assert same_under_dtr(step, setup).evictions > 0


@pytest.mark.parametrize('written', ['parameter', 'activation', 'data'])
def test_saved_tensor_written_before_backward_raises(written):
    # saved-tensor hooks turn autograd's version check off; the engine does
    # it instead, at any threshold (and refuses a write through .data,
    # which eager autograd would allow, rather than rebuild the old value)
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
            (a.data if written == 'data' else a).mul_(2)
        with pytest.raises(RuntimeError, match='modified by an inplace'):
            y.backward()


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


def test_strided_nested_tensors_are_held(same_under_dtr):
    # a nested tensor has no strides to rebuild a view from: held (R4);
    # the engine crashed on it (an abort, from inside the dispatch mode)
    lin = nn.Linear(8, 8)

    def step():
        lin.zero_grad()
        nested = torch.nested.nested_tensor(
            [torch.randn(3, 8), torch.randn(5, 8)], requires_grad=True)
        out = torch.nested.to_padded_tensor(lin(nested).relu(), 0.0)
        loss = (out * 2).exp().sum()
        loss.backward()
        return [loss, lin.weight.grad, lin.bias.grad]

    same_under_dtr(step)


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


def test_saved_subclass_keeps_its_data():
    # a wrapper subclass saved for backward is kept as it is: detached below
    # its __torch_dispatch__ it would have no data
    from torch.testing._internal.two_tensor import TwoTensor
    grads = []
    for dtr in (False, True):
        torch.manual_seed(0)
        t = TwoTensor(torch.randn(64), torch.randn(64)).requires_grad_()
        with DTR(eviction_threshold='1GB', evictee_minimum_size=1) if dtr \
                else torch.enable_grad():
            (t * 1.0).sin().sum().backward()
        grads.append(t.grad)
    assert torch.equal(grads[0].a, grads[1].a)
    assert torch.equal(grads[0].b, grads[1].b)


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
