"""Recording from a threshold on (design.md R16): the engine's saved-tensor
hooks wait for recording to start where PyTorch tells whether another hooks
context is active (2.8 and later), and are pushed only where they stay.
"""
import pytest
import torch

from mmdtr.core.torch_compat import (can_read_saved_tensor_hooks,
                                     outer_saved_tensor_hooks)
from mmdtr.dtr import DTR
from .test_recording_threshold import _chain, chain_engine, eager_chain


def _hooks_in_force():
    """The pack hook on top of this thread's stack, or ``None``."""
    return outer_saved_tensor_hooks()


needs_hooks_reader = pytest.mark.needs_hooks_on_top


@needs_hooks_reader
def test_hooks_are_pushed_when_recording_starts():
    x = torch.randn(128, 128, requires_grad=True)
    size = 128 * 128 * 4
    with DTR(
            eviction_threshold=12 * size,
            evictee_minimum_size=1,
            recording_threshold=4 * size) as engine:
        assert _hooks_in_force() is None  # idle: autograd saves as eager
        h = x
        for _ in range(3):
            h = (h * 1.0001).tanh()
        assert engine.stats.idle_ops == engine.stats.ops
        assert _hooks_in_force() is None
        loss, _ = _chain(h, 12)
        assert _hooks_in_force() is not None  # recording: the engine's
        loss.backward()
    assert _hooks_in_force() is None
    assert 0 < engine.stats.idle_ops < engine.stats.ops


@needs_hooks_reader
@pytest.mark.parametrize('context', ['save_on_cpu', 'checkpoint'])
def test_recording_waits_for_another_hooks_context_to_end(context):
    """Pushed above another context, the engine's hooks would be popped by
    its exit: recording starts at the first op after it."""
    x = torch.randn(128, 128, requires_grad=True)
    size = 128 * 128 * 4

    def inner(h):
        for _ in range(8):
            h = (h * 1.0001).tanh()
        return h

    def step():
        if context == 'save_on_cpu':
            with torch.autograd.graph.save_on_cpu():
                h = inner(x)
        else:
            h = torch.utils.checkpoint.checkpoint(
                inner, x, use_reentrant=False)
        return _chain(h, 12)[0]

    expected = step()
    expected.backward()
    grad, x.grad = x.grad, None
    with DTR(
            eviction_threshold=10 * size,
            evictee_minimum_size=1,
            recording_threshold=2 * size) as engine:
        got = step()
        got.backward()
    assert torch.equal(got, expected) and torch.equal(x.grad, grad)
    stats = engine.stats
    # recording started after the context, where memory was long past the
    # recording threshold: its ops (forward, and checkpoint's recomputation
    # in backward) ran idle
    assert stats.idle_ops >= 16 and stats.evictions > 0


def test_recording_never_starts_in_backward():
    """Memory passes the recording threshold only in backward (the
    gradients): autograd would undo hooks pushed there (R12)."""
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(8, 256)
    with DTR(eviction_threshold=2**30, recording_threshold=2**18) as engine:
        y = (x @ w).tanh().sum()
        forward_ops = engine.stats.ops
        assert engine.stats.idle_ops == forward_ops
        y.backward()  # the gradient of w: 256 KiB
    assert engine.stats.peak_memory > 2**18
    if can_read_saved_tensor_hooks():
        assert engine.stats.idle_ops == engine.stats.ops  # never recorded
    assert _hooks_in_force() is None


def test_hooks_from_the_start_where_they_cannot_wait(monkeypatch):
    """PyTorch before 2.8 cannot tell whether another hooks context is on
    the stack: the engine's are pushed at the start, and idle ops' saved
    tensors are held with their version (as eager checks it)."""
    from mmdtr.core import idle_ops
    monkeypatch.setattr(idle_ops, 'can_read_saved_tensor_hooks', lambda: False)
    x = torch.randn(128, 128, requires_grad=True)
    expected, grad = eager_chain(x, 24)
    with chain_engine(128 * 128 * 4) as engine:
        if can_read_saved_tensor_hooks():
            assert _hooks_in_force() is not None
        loss, _ = _chain(x, 24)
        loss.backward()
    assert torch.equal(loss, expected) and torch.equal(x.grad, grad)
    assert 0 < engine.stats.idle_ops < engine.stats.ops
    assert engine.stats.evictions > 0
    with DTR(eviction_threshold='1GB', recording_threshold='512MB'):
        h = torch.randn(4, requires_grad=True).sigmoid()  # saves its output
        h.mul_(2)  # eager refuses the backward: so must the engine
        with pytest.raises(RuntimeError, match='modified by an inplace'):
            h.sum().backward()


@needs_hooks_reader
def test_recording_waits_while_saved_tensor_hooks_are_disabled():
    x = torch.randn(128, 128, requires_grad=True)
    size = 128 * 128 * 4

    def step(engine=None):
        h = x
        with torch.autograd.graph.disable_saved_tensors_hooks('no hooks'):
            for _ in range(8):
                h = (h * 1.0001).tanh()  # pushing hooks here would raise
            if engine is not None:
                assert engine.stats.idle_ops == engine.stats.ops
                assert _hooks_in_force() is None
        loss, _ = _chain(h, 8)
        if engine is not None:
            assert _hooks_in_force() is not None  # pushed after it
        loss.backward()
        return loss

    expected = step()
    grad, x.grad = x.grad, None
    with DTR(
            eviction_threshold=10 * size,
            evictee_minimum_size=1,
            recording_threshold=2 * size) as engine:
        got = step(engine)
    assert torch.equal(got, expected) and torch.equal(x.grad, grad)
    assert 0 < engine.stats.idle_ops < engine.stats.ops
    assert engine.stats.evictions > 0


@needs_hooks_reader
def test_a_threshold_not_held_while_recording_waits_is_reported():
    """A whole model under non-reentrant checkpointing: its hooks stay
    on the stack, recording never starts, nothing can be evicted, and the
    threshold is reported not held (found by a review)."""
    x = torch.randn(128, 128, requires_grad=True)
    size = 128 * 128 * 4

    def model(h):
        for _ in range(16):
            h = (h * 1.0001).tanh()
        return h.sum()

    with DTR(
            eviction_threshold=4 * size,
            evictee_minimum_size=1,
            recording_threshold=2 * size) as engine:
        torch.utils.checkpoint.checkpoint(
            model, x, use_reentrant=False).backward()
    stats = engine.stats
    assert stats.idle_ops == stats.ops and stats.evictions == 0
    assert stats.eviction_failures > 0 and stats.peak_memory > 4 * size
