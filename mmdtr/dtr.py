"""MegEngine-compatible DTR switches, plus the scoped engine.

Examples:
    >>> from mmdtr import dtr
    >>> dtr.eviction_threshold = '5GB'
    >>> dtr.evictee_minimum_size = '1MB'
    >>> dtr.enable()     # the training code that follows runs under DTR
    >>> ...
    >>> dtr.disable()

    >>> with dtr.DTR(eviction_threshold='2GB') as engine:
    ...     model(x).sum().backward()
    >>> engine.stats.evictions

Assigning a switch validates its value at once; assigning any other name
that the module does not define (a misspelt switch, ``dtr.policy``, a
private ``_name`` too; dunder names aside) raises
:class:`~mmdtr.errors.MmdtrError`, and the switches cannot be deleted.
Names the module defines or imports (``enable``, ``DTR``, ...) can still
be replaced, e.g. by ``monkeypatch.setattr``.
"""
import difflib
import sys
import threading
import types

from mmdtr.errors import MmdtrError
from .core.dtr_mode import DTR, DTRStats, engine_active
from .core.policies import (POLICIES, DTRPolicy, EvictionPolicy,
                            LargestFirstPolicy, LocalDTRPolicy, LRUPolicy,
                            register_policy)
from .core.sizes import parse_size

__all__ = [
    'DTR', 'DTRStats', 'EvictionPolicy', 'POLICIES', 'register_policy',
    'DTRPolicy', 'LocalDTRPolicy', 'LRUPolicy', 'LargestFirstPolicy', 'enable',
    'disable', 'is_enabled', 'current_engine', 'engine_active',
    'eviction_threshold', 'evictee_minimum_size', 'enable_sqrt_sampling'
]

#: Evict while memory in use exceeds this ('5GB', bytes). ``None``/0: only
#: on allocation failure (CUDA only).
eviction_threshold = None
#: Storages smaller than this are never evicted. Defaults to 1 MiB.
evictee_minimum_size = 2**20
#: Score about sqrt(N) sampled candidates per eviction.
enable_sqrt_sampling = False

_local = threading.local()  # engines are per thread


def enable() -> DTR:
    """Turn DTR on for this thread with the module-level settings.

    The settings are read here: changing one while DTR is enabled on this
    thread is refused (MegEngine applies them at once); disable, set, and
    enable again.

    Returns:
        DTR: The active engine (its ``stats`` are live).

    Raises:
        MmdtrError: If DTR is already enabled on this thread, another engine
            (``with DTR(...)``) is active on it, or a setting is invalid
            (nothing is changed then).
    """
    if is_enabled():
        raise MmdtrError('DTR is already enabled on this thread.',
                         'Call mmdtr.dtr.disable() first.')
    # read once: another thread may set them since (found by an
    # adversarial search; a review: read twice, around __enter__)
    switches = {name: globals()[name] for name in _SWITCHES}
    engine = DTR(**switches)
    engine.__enter__()
    _local.engine, _local.switches = engine, switches
    return engine


def disable() -> DTRStats:
    """Turn DTR off for this thread and return what the engine did.

    Returns:
        DTRStats: The stats of the engine :func:`enable` started.

    Raises:
        MmdtrError: If DTR is not enabled on this thread.
    """
    engine = getattr(_local, 'engine', None)
    if engine is None:
        raise MmdtrError('DTR is not enabled on this thread.',
                         'Call mmdtr.dtr.enable() first.')
    try:
        engine.__exit__(None, None, None)
    finally:
        if not engine.active:  # closed, or closed by hand before
            _local.engine = _local.switches = None
    return engine.stats


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect on this thread."""
    return getattr(_local, 'engine', None) is not None


def current_engine():
    """The engine :func:`enable` started on this thread, or ``None``."""
    return getattr(_local, 'engine', None)


def _check_bool(value, key) -> bool:
    if not isinstance(value, bool):
        raise MmdtrError(f'{key}={value!r} is not a bool.',
                         'Use True or False.')
    return value


#: The module-level switches and the check their values pass at assignment
#: (a threshold of None is checked against the device only by enable()).
_SWITCHES = {
    'eviction_threshold': lambda v, k: parse_size(v, k, allow_none=True),
    'evictee_minimum_size': parse_size,
    'enable_sqrt_sampling': _check_bool,
}
_DEFAULTS = {name: globals()[name] for name in _SWITCHES}
_ENGINE_ONLY = ('policy', 'device', 'recording_threshold')  # DTR() only


class _DTRModule(types.ModuleType):
    """``mmdtr.dtr`` itself: refuses unknown switches and bad values."""

    def __setattr__(self, name, value):
        if name in _SWITCHES:
            check = _SWITCHES[name]
            parsed = check(value, f'mmdtr.dtr.{name}')
            # the same setting passes ('3GB' is 3221225472; found by a
            # review)
            read = _local.switches if is_enabled() else {}
            if name in read and parsed != check(read[name], name):
                # it took effect at the next enable() only: a change that
                # seemed applied was not (found by an adversarial search)
                raise MmdtrError(
                    f'mmdtr.dtr.{name}={value!r}: DTR is enabled on this '
                    'thread, and its engine read the switches at enable() '
                    f'({name}={read[name]!r}).',
                    'Call mmdtr.dtr.disable(), set the switch, then '
                    'mmdtr.dtr.enable() again.')
        elif not (name in vars(self) or name.startswith('__')):
            _refuse_unknown(name)
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if name in _SWITCHES:
            raise MmdtrError(
                f'mmdtr.dtr.{name} is a DTR switch and cannot be deleted.',
                f'Assign its default instead (see {_DEFAULTS}).')
        super().__delattr__(name)


def _refuse_unknown(name):
    switches = list(_SWITCHES)
    close = difflib.get_close_matches(name, switches, n=1)
    message = (f'mmdtr.dtr.{name} is not a DTR switch; accepted: '
               f'{switches}')
    message += f', closest match: {close[0]!r}.' if close else '.'
    if name in _ENGINE_ONLY:
        hint = (f'{name} is an argument of the scoped engine: '
                f'`with mmdtr.dtr.DTR({name}=...):`.')
    else:
        hint = f'Set one of {switches}, then call mmdtr.dtr.enable().'
    raise MmdtrError(message, hint)


sys.modules[__name__].__class__ = _DTRModule
