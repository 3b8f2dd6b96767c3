"""The one lock every engine holds while it runs its bookkeeping (R12 of
docs/design.md), the open engines, and what a fork does to both."""
import os
import threading
import weakref

from .interrupts import interrupt_safe

# One lock for every engine (R12): a thread holding an engine's lock may
# free a storage another engine counts, whose callback takes that one's
# lock; with a lock per engine, two threads doing so at once deadlocked.
# It is let go while the kernel of an op writing no argument runs.
ENGINE_LOCK = threading.RLock()
OPEN_ENGINES = weakref.WeakSet()  # the states not closed yet


def _after_fork_in_child():
    ENGINE_LOCK.release()
    for state in list(OPEN_ENGINES):
        state.stop_in_forked_child()


if hasattr(os, 'register_at_fork'):
    # a fork (DataLoader workers) while another thread held the lock left
    # the child's copy held by no thread: its first op under the engine it
    # inherited waited forever (found by a review). The forking thread takes
    # the lock first; parent and child let it go (R12).
    os.register_at_fork(
        before=ENGINE_LOCK.acquire,
        after_in_parent=ENGINE_LOCK.release,
        after_in_child=_after_fork_in_child)


@interrupt_safe
def released(lock):
    """``lock`` let go for the duration (once: a reentrant hold stays)."""
    count = holds(lock)
    try:  # an interrupt right after the release is inside: taken back
        lock.release()
        yield
    finally:
        take_back(lock, count)


def holds(lock) -> int:
    """How many times this thread holds ``lock`` (an ``RLock``)."""
    try:
        return lock._recursion_count()
    except AttributeError:  # an RLock of Python before 3.11 (held once)
        return int(lock._is_owned())


def take_back(lock, count: int) -> None:
    """Acquire ``lock`` again, to ``count`` holds by this thread. An
    interrupt while ``acquire`` waits for another thread leaves it not
    taken (POSIX), one as it returns leaves it taken: the count tells, and
    the interrupt goes on once the lock is held (a review)."""
    try:
        lock.acquire()
    except KeyboardInterrupt:
        while holds(lock) < count:
            try:
                lock.acquire()
            except KeyboardInterrupt:
                pass
        raise
