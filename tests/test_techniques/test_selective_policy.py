"""Selective checkpointing policies: what a policy may keep, and when."""
import re

import pytest
import torch
import torch.nn as nn

from mmdtr.core.torch_compat import CheckpointPolicy
from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import \
    apply_activation_checkpointing
from mmdtr.techniques.selective_policy import normalize_policy, save_policy

if CheckpointPolicy is None:  # refused there: test_activation_checkpointing
    pytest.skip(
        'selective checkpointing needs PyTorch >= 2.5',
        allow_module_level=True)


@pytest.mark.parametrize(
    'ops, why',
    [
        (['rrelu_with_noise'], "writes its argument 'noise'"),
        (['addmm', 'rand'], "'rand' draws random numbers"),
        (['bernoulli'], 'draws random numbers'),
        (['native_dropout'], 'draws random numbers'),
        (['_fused_dropout'], 'draws random numbers'),  # not its out= reason
        (['aten.dropout'], 'draws random numbers'),
        (['add_'], 'writes its input in place'),
    ])
def test_ops_a_recompute_must_run_are_refused(ops, why):
    # accepted, a kept rrelu_with_noise left the noise its backward reads
    # uninitialised (gradients off by up to 210), and a kept random op
    # shifted the RNG stream of the recompute, so a dropout after it drew
    # another mask (found by an adversarial search)
    with pytest.raises(MmdtrError, match=why):
        normalize_policy(ops)


def test_batch_norm_writing_running_stats_may_be_kept():
    names = normalize_policy(['_native_batch_norm_legit', 'native_batch_norm'])
    assert len(save_policy(names).overloads) == 3


@pytest.mark.parametrize(
    'args, kwargs, decision',
    [
        ((0.0, ), {}, CheckpointPolicy.MUST_SAVE),
        ((), {}, CheckpointPolicy.MUST_SAVE),  # dropout_p's default, 0
        ((0.1, ), {}, CheckpointPolicy.PREFER_RECOMPUTE),
        ((), dict(dropout_p=0.1), CheckpointPolicy.PREFER_RECOMPUTE),
        ((), dict(dropout_p=0.0), CheckpointPolicy.MUST_SAVE),
    ])
def test_attention_is_kept_only_without_dropout(args, kwargs, decision):
    # with dropout it draws (CUDA's flash and efficient kernels): kept, the
    # recompute would skip its draw and shift the RNG stream after it
    policy = save_policy(normalize_policy('save_compute_heavy'))
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.zeros(1, 1, 2, 4)
    before = (q, q, q, None, False)  # query, key, value, bias, log_sumexp
    assert policy(None, op, *before, *args, **kwargs) is decision
    mm = torch.ops.aten.mm.default
    assert policy(None, mm, q, q) is CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.relu.default,
                  q) is CheckpointPolicy.PREFER_RECOMPUTE


def test_a_cast_taken_from_autocasts_cache_is_explained_or_exact():
    # PyTorch's own error named neither the module nor the cause (found by
    # an adversarial search: a shared Linear under the AMP wrapper). Torch
    # 2.13 checks every op of the recompute against the forward's and fails;
    # torch 2.11 (seen on the H100) recomputes the cast and runs: then the
    # gradients must be those of the module without checkpointing
    def step(module, **autocast):
        torch.manual_seed(0)
        x = torch.randn(4, 8)
        with torch.autocast('cpu', dtype=torch.bfloat16, **autocast):
            y = module(nn.functional.gelu(module(x)))  # the weight cast once
        y.float().sum().backward()
        grads = [p.grad for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return grads

    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    eager = step(shared)
    apply_activation_checkpointing(
        nn.ModuleDict(dict(s=shared)), ['s'], policy='save_matmuls')
    try:
        grads = step(shared)
    except MmdtrError as exc:
        assert re.search("Linear 's' under a selective .*cache_enabled=False",
                         str(exc))
    else:
        assert all(map(torch.equal, grads, eager))
    uncached = step(shared, cache_enabled=False)  # as the hint says
    torch.manual_seed(0)
    plain = nn.Linear(8, 8)
    assert all(map(torch.equal, uncached, step(plain, cache_enabled=False)))
