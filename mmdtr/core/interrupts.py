"""Putting process-wide state back through an interrupt.

Python raises ``KeyboardInterrupt`` (Ctrl-C) where it next checks for
signals: right after a call returns, or at a loop's jump back. One raised
in the middle of code that puts process-wide state back (the default
dtype, the backend switches, the legacy vmap level) left it half put back
for the rest of the process (found by an adversarial search: every later
backward of the thread failed, with DTR or without). And one raised as
``contextlib``'s ``__enter__`` returns from the generator's first step
skips the exit: the ``with`` never began (a review). Hence
:func:`put_back` and :func:`interrupt_safe`.
"""
import contextlib
import functools
import inspect
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


class _InterruptSafe:
    """A generator context whose exit runs even when an exception is
    raised as its ``__enter__`` returns from the generator's first step:
    the generator is then suspended at its ``yield``, its change made, and
    the exception is thrown in there (so its ``finally`` puts back)."""
    __slots__ = ('context', )

    def __init__(self, context):
        self.context = context

    def __enter__(self):
        first = inspect.getgeneratorstate(
            self.context.gen) == inspect.GEN_CREATED
        try:
            return self.context.__enter__()
        except BaseException as error:
            state = inspect.getgeneratorstate(self.context.gen)
            if first and state == inspect.GEN_SUSPENDED:
                self.context.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(self, exc_type, exc, tb):
        return self.context.__exit__(exc_type, exc, tb)


def interrupt_safe(generator_function: Callable) -> Callable:
    """:func:`contextlib.contextmanager`, whose exit also runs for an
    exception raised as its ``__enter__`` returns (an interrupt).

    Args:
        generator_function (Callable): As for ``contextmanager``: makes
            its change, yields once inside the ``try`` whose ``finally``
            puts it back.

    Returns:
        Callable: Makes the context.
    """
    context = contextlib.contextmanager(generator_function)

    @functools.wraps(generator_function)
    def make(*args, **kwargs):
        return _InterruptSafe(context(*args, **kwargs))

    return make
