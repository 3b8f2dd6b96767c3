"""Putting process-wide state back through an interrupt.

Python raises ``KeyboardInterrupt`` (Ctrl-C) where it next checks for
signals: right after a call returns, or at a loop's jump back. One raised
in the middle of code that puts process-wide state back (the default
dtype, the backend switches, the legacy vmap level) left it half put back
for the rest of the process (found by an adversarial search: every later
backward of the thread failed, with DTR or without).
"""
from typing import Callable

#: how many times :func:`put_back` runs a restore cut short
TRIES = 3


def put_back(restore: Callable[[], None]) -> None:
    """Run ``restore`` to its end: cut short by an interrupt, it runs
    again (so it must be idempotent, or count its own progress), and the
    interrupt is raised once it has completed.

    Args:
        restore (Callable): Puts the state back; may run more than once.

    Raises:
        KeyboardInterrupt: The interrupt that cut it short, after it ran
            to its end (or :data:`TRIES` times).
    """
    interrupt = None
    for _ in range(TRIES):
        try:
            restore()
        except KeyboardInterrupt as e:
            interrupt = e
            continue
        break
    if interrupt is not None:
        raise interrupt
