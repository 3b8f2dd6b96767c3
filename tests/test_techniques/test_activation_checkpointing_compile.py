"""Activation checkpointing under torch.compile: bit-identical training,
one graph, and the refusal where BatchNorm statistics would update twice."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import (
    _COMPILED_STATS_ONCE, apply_activation_checkpointing)
from .test_activation_checkpointing import (ConvNet, _assert_bit_identical,
                                            _conv_batch)


@pytest.mark.parametrize('policy', [
    None,
    pytest.param(
        'save_compute_heavy', marks=pytest.mark.needs_selective_checkpointing)
])
def test_torch_compile_bit_identical(policy, dynamo_compiles):
    """Under torch.compile (aot_eager: dynamo + AOTAutograd, no C++)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = ConvNet(depth=1)
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, 'layer*', policy)
    compiled = torch.compile(ckpt, backend='aot_eager')
    x, y = _conv_batch()
    if not _COMPILED_STATS_ONCE:  # PyTorch before 2.9
        with pytest.raises(MmdtrError, match='running statistics a second'):
            compiled(x)
        return
    loss_plain = F.cross_entropy(plain(x), y)
    loss_plain.backward()
    loss_ckpt = F.cross_entropy(compiled(x), y)
    loss_ckpt.backward()
    _assert_bit_identical(plain, ckpt, [loss_plain.detach()],
                          [loss_ckpt.detach()])
    assert int(ckpt.layer1[0][1].num_batches_tracked) == 1


@pytest.mark.fails_before_torch(
    (2, 5),
    reason='dynamo 2.4 breaks the graph at named_modules, which the '
    'BatchNorm refusal reads there')
def test_torch_compile_makes_one_graph_of_checkpointed_modules(
        dynamo_compiles):
    # the forward beneath the checkpoint was bound by MethodType for a
    # while: a graph break per checkpointed module (2.8 to 2.13)
    from torch._dynamo.utils import counters
    model = ConvNet(depth=1).eval()  # eval: not refused before 2.9
    apply_activation_checkpointing(model, 'layer*')
    counters.clear()
    torch.compile(model, backend='aot_eager')(_conv_batch()[0])
    assert not counters['graph_break']
    assert counters['stats']['unique_graphs'] == 1


@pytest.mark.needs_selective_checkpointing
def test_torch_compile_takes_a_selective_policy_without_norms(dynamo_compiles):
    # no BatchNorm: compiled on every PyTorch with selective checkpointing.
    # Dynamo before 2.10 failed at the first call while the policy was an
    # object with __call__ (seen on 2.9.1)
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(),
        nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 4))
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, '2', 'save_compute_heavy')
    compiled = torch.compile(ckpt, backend='aot_eager')
    x = torch.randn(8, 16)
    loss_plain = plain(x).square().sum()
    loss_plain.backward()
    loss_ckpt = compiled(x).square().sum()
    loss_ckpt.backward()
    _assert_bit_identical(plain, ckpt, [loss_plain.detach()],
                          [loss_ckpt.detach()])


def test_torch_compile_refused_where_stats_would_update_twice(
        monkeypatch, dynamo_compiles):
    # before PyTorch 2.9 the compiled recompute updated BatchNorm's
    # running statistics a second time: refused there, loudly
    from mmdtr.techniques import activation_checkpointing
    monkeypatch.setattr(activation_checkpointing, '_COMPILED_STATS_ONCE',
                        False)
    torch._dynamo.reset()
    model = ConvNet(depth=1)
    apply_activation_checkpointing(model, 'layer*')
    compiled = torch.compile(model, backend='aot_eager')
    x, _ = _conv_batch()
    with pytest.raises(MmdtrError, match='running statistics a second'):
        compiled(x)
    torch._dynamo.reset()
    compiled = torch.compile(model.eval(), backend='aot_eager')
    compiled(x)  # no statistics updated: not refused
