"""What stands in for the PyTorch features 2.4 lacks
(mmdtr/core/torch_compat.py), checked on the PyTorch installed, and with
2.4's way forced where this one has the newer feature."""
import pytest
import torch

from mmdtr.core import torch_compat
from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError


@pytest.fixture(params=['installed', 'as on 2.4'])
def hooks_reader(request, monkeypatch):
    if request.param == 'as on 2.4':
        monkeypatch.setattr(torch_compat, '_top_hooks', None)
    return request.param


def test_saved_tensor_hooks_are_seen(hooks_reader):
    assert torch_compat.outer_saved_tensor_hooks() is None

    def pack_outer(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_outer, lambda t: t):
        owner = torch_compat.outer_saved_tensor_hooks()
    expected = 'unknown' if torch_compat._top_hooks is None else \
        pack_outer.__qualname__
    assert owner == expected
    with torch.autograd.graph.save_on_cpu(), torch.no_grad():
        assert torch_compat.outer_saved_tensor_hooks() is not None
    with torch.inference_mode():
        assert torch_compat.outer_saved_tensor_hooks() is None


def test_the_probe_draws_nothing_and_leaves_grad_mode(hooks_reader):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch_compat.outer_saved_tensor_hooks() is None
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.rand(3), expected)


def test_dtr_inside_other_hooks_is_refused_either_way(hooks_reader):
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(MmdtrError, match='inside another saved-tensor'):
            with DTR(eviction_threshold='1GB'):
                pass
    with DTR(eviction_threshold='1GB') as engine:  # nothing left behind
        torch.ones(2, requires_grad=True).exp().sum().backward()
    assert engine.stats.ops > 0
    assert torch_compat.outer_saved_tensor_hooks() is None


def test_storage_object_uses_match_an_unreferenced_storage():
    # R3's exclusivity test: the uses of a storage held by one tensor alone,
    # once its Python object was made and let go
    t = torch.randn(8).exp()
    cdata = t.untyped_storage()._cdata
    uses = torch._C._storage_Use_Count(cdata)
    assert uses == 1 + torch_compat.STORAGE_OBJECT_USES
    alias = t.detach()
    assert torch._C._storage_Use_Count(cdata) == uses + 1
    del alias


def test_an_evicted_storage_is_freed_and_rebuilt_exactly():
    # a wrong count of the storage's own object makes every storage look
    # visible (nothing evicted, as on PyTorch 2.4 before it was read here)
    x = torch.randn(1 << 16, requires_grad=True)
    expected = torch.autograd.grad(x.exp().sin().sum(), x)[0]
    with DTR(eviction_threshold=1, evictee_minimum_size=1) as engine:
        h = x.exp()
        loss = h.sin().sum()
        del h
        # far above the limit, raised while h was visible: h is evicted
        torch.ones(1 << 20).add_(1)
        grad = torch.autograd.grad(loss, x)[0]
    assert torch.equal(grad, expected)
    assert engine.stats.evictions > 0 and engine.stats.recomputations > 0
