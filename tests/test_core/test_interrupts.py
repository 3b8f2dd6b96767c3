"""An interrupt (Ctrl-C) inside the engine leaves no process-wide state
behind (``core/interrupts.py``).

Python raises ``KeyboardInterrupt`` where it next checks for signals,
right after a call returns: each case makes one of the engine's calls raise
it there, the way the handler would. Found by an adversarial search; each
failed before its fix.
"""
import threading

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from mmdtr.core import collector, engine
from mmdtr.core.interrupts import put_back
from mmdtr.dtr import DTR, engine_active

W = torch.randn(16, 16)


def _chain_step(w):
    h = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    for _ in range(6):
        h = (h @ w).tanh()
    h.sum().backward()


def _legacy_vmap_level():
    level = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    return level


@pytest.mark.parametrize(
    'name', ['_vmapmode_increment_nesting', '_vmapmode_decrement_nesting'])
def test_an_interrupt_in_a_rebuild_leaves_the_vmap_level(monkeypatch, name):
    # it stayed one too high: every later backward of the thread raised
    # "backward() called inside torch.vmap", with DTR or without
    real, calls = getattr(torch._C, name), []

    def interrupted_once():
        out = real()
        calls.append(out)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return out

    w = W.clone().requires_grad_()
    monkeypatch.setattr(torch._C, name, interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        with DTR(eviction_threshold=1, evictee_minimum_size=0):
            _chain_step(w)
    monkeypatch.undo()
    assert calls, 'no rebuild ran'
    assert _legacy_vmap_level() == 0
    w.grad = None
    _chain_step(w)  # plain eager
    assert w.grad is not None


def test_an_interrupt_while_putting_the_dtype_back(monkeypatch):
    # a replay runs under the recorded default dtype; cut short, the
    # restore left it in force for the process
    real, interrupted = torch.set_default_dtype, []

    def set_default_dtype(dtype):
        if dtype is torch.float64 and not interrupted:
            interrupted.append(dtype)
            raise KeyboardInterrupt  # before the restore ran
        real(dtype)

    w = W.clone().requires_grad_()
    try:
        with pytest.raises(KeyboardInterrupt):
            with DTR(eviction_threshold=1, evictee_minimum_size=0):
                h = torch.randn(4, 16)
                for _ in range(6):
                    h = (h @ w).tanh()
                real(torch.float64)  # changed before backward
                monkeypatch.setattr(torch, 'set_default_dtype',
                                    set_default_dtype)
                h.sum().backward()
        assert interrupted
        assert torch.get_default_dtype() is torch.float64
    finally:
        real(torch.float32)


def test_put_back_finishes_and_raises_the_interrupt():
    done = []

    def restore():
        if not done:
            done.append('cut short')
            raise KeyboardInterrupt
        done.append('ran to its end')

    with pytest.raises(KeyboardInterrupt):
        put_back(restore)
    assert done == ['cut short', 'ran to its end']
    put_back(lambda: done.append('once'))
    assert done[-2:] == ['ran to its end', 'once']


def test_an_interrupt_while_entering_leaves_nothing(monkeypatch):
    # `with` calls no __exit__ when __enter__ raises: the mode and hooks
    # stayed on the thread, and every later engine was refused
    real = collector.space_collections

    def interrupted(engine):
        raise KeyboardInterrupt

    monkeypatch.setattr(collector, 'space_collections', interrupted)
    with pytest.raises(KeyboardInterrupt):
        with DTR(eviction_threshold='1GB'):
            pass
    monkeypatch.setattr(collector, 'space_collections', real)
    assert not _get_current_dispatch_mode_stack()
    assert not engine_active()
    w = W.clone().requires_grad_()
    with DTR(eviction_threshold=1, evictee_minimum_size=0) as dtr:
        _chain_step(w)
    assert dtr.stats.recomputations > 0


class _InterruptedRelease:
    """The engines' lock, whose armed ``release`` raises the interrupt
    once it has let go."""

    def __init__(self):
        self.lock, self.armed = threading.RLock(), False

    def acquire(self, *args):
        return self.lock.acquire(*args)

    def _recursion_count(self):
        return self.lock._recursion_count()

    def release(self):
        self.lock.release()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def __enter__(self):
        return self.lock.__enter__()

    def __exit__(self, *exc_info):
        return self.lock.__exit__(*exc_info)


def test_an_interrupt_as_a_kernel_starts_stays_an_interrupt(monkeypatch):
    # the lock is let go while an op's kernel runs: interrupted right
    # after, the dispatch mode's release failed instead ("cannot release
    # un-acquired lock"), and `except KeyboardInterrupt` missed it
    lock = _InterruptedRelease()
    monkeypatch.setattr(engine, 'ENGINE_LOCK', lock)
    w = W.clone().requires_grad_()
    with pytest.raises(KeyboardInterrupt):
        with DTR(eviction_threshold='1GB'):
            h = torch.randn(4, 16) @ w
            lock.armed = True
            h.tanh()
    assert not lock.armed
    assert lock.acquire(False)  # not held by anyone
    lock.release()


def test_an_interrupt_while_putting_the_switches_back(monkeypatch):
    # the switches a call ran under (thread count, backend flags) are put
    # back after its replay; cut short, some stayed as recorded
    from mmdtr.core import backend_flags
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    torch.set_num_threads(other)
    recorded = backend_flags.current()
    torch.set_num_threads(before)
    real, calls = backend_flags._put, []

    def put(values, now):
        calls.append(values)
        if len(calls) == 2:  # the first restore, cut short at its start
            raise KeyboardInterrupt
        real(values, now)

    monkeypatch.setattr(backend_flags, '_put', put)
    try:
        with pytest.raises(KeyboardInterrupt):
            with backend_flags.switched_to(recorded):
                assert torch.get_num_threads() == other
        assert len(calls) == 3
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def _interrupt_as_entered(generator_name):
    """Raise the interrupt where Python checks for signals as contextlib's
    ``__enter__`` gets the generator's ``yield`` back (its ``next``
    returns), once."""
    import sys

    def profile(frame, event, arg):
        if event == 'c_return' and arg is next \
                and frame.f_code.co_name == '__enter__' \
                and frame.f_locals['self'].gen.__name__ == generator_name:
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(profile)


def test_an_interrupt_as_a_context_is_entered_still_exits():
    # the `with` had not begun, so its exit never ran: the lock stayed let
    # go, the vmap level lowered, while the traceback lived (as a REPL's
    # last one does; found by a review)
    from mmdtr.core.engine_lock import released
    from mmdtr.core.replay_settings import outside_vmap, recorded_default_dtype
    lock = threading.RLock()
    with lock:
        _interrupt_as_entered('released')
        with pytest.raises(KeyboardInterrupt) as caught:
            with released(lock):
                pass
        assert lock._is_owned(), caught
    torch._C._vmapmode_increment_nesting()  # as is_grads_batched does
    try:
        _interrupt_as_entered('outside_vmap')
        with pytest.raises(KeyboardInterrupt) as caught:
            with outside_vmap():
                pass
        assert _legacy_vmap_level() == 1, caught
    finally:
        torch._C._vmapmode_decrement_nesting()
    _interrupt_as_entered('recorded_default_dtype')
    with pytest.raises(KeyboardInterrupt) as caught:
        with recorded_default_dtype(torch.float64):
            pass
    assert torch.get_default_dtype() is torch.float32, caught


class _AcquireInterruptedOnce:
    """An RLock whose first ``acquire`` is cut short while it waits, as
    Ctrl-C does on POSIX: raised, not taken."""

    def __init__(self):
        self.lock, self.interrupted = threading.RLock(), False

    def acquire(self, *args):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return self.lock.acquire(*args)

    def _recursion_count(self):
        return self.lock._recursion_count()


def test_an_interrupt_while_waiting_for_the_lock_still_takes_it():
    # while another thread held it, acquire raised without taking it, and
    # the engine went on without its lock (found by a review)
    from mmdtr.core.engine_lock import take_back
    lock = _AcquireInterruptedOnce()
    with pytest.raises(KeyboardInterrupt):
        take_back(lock, 1)
    assert lock.interrupted and lock.lock._recursion_count() == 1
    lock.lock.release()


def test_an_error_entering_a_context_again_leaves_the_first_alone():
    # contextlib refuses a context entered twice; that error was taken for
    # an interrupt of the first step, and the lock taken back inside the
    # first `with` (a review)
    from mmdtr.core.engine_lock import released
    lock = threading.RLock()
    with lock:
        context = released(lock)
        with context:
            with pytest.raises((AttributeError, RuntimeError)):
                with context:
                    pass
            assert not lock._is_owned()
        assert lock._is_owned()
