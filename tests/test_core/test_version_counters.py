"""Version counters under DTR (R10): a write through a counter another
tensor shares is refused as eager refuses it, one through a counter of its
own is used, and every op bumps counters as eager does (foreach lists,
writes that fail half-way, subclass arguments).

``refused_like_eager`` and ``same_under_dtr`` compare with eager at any
threshold. Each case failed on an engine before its fix.
"""
import pytest
import torch

from mmdtr.dtr import DTR
from .test_version_checks import forward_then_backward


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

    refused_like_eager(forward_then_backward(forward, w))


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

    stats = same_under_dtr(forward_then_backward(forward, w))
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

    same_under_dtr(forward_then_backward(forward, w))


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


@pytest.mark.fails_before_torch(
    (2, 6),
    reason='this test\'s pass-through subclass cannot go back to '
    'a plain tensor (as_subclass) on PyTorch 2.4 and 2.5')
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

    same_under_dtr(forward_then_backward(forward, w))


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
        # nor those of the tensors it holds (a review: bumped once the
        # engine saw them written, they failed autograd's check)
        versions.append((a._version, a.a._version, a.b._version))
    assert versions[0] == versions[1]
