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
"""
import threading

from mmdtr.errors import MmdtrError
from .core.dtr_mode import DTR, DTRStats
from .core.policies import POLICIES, EvictionPolicy

__all__ = [
    'DTR', 'DTRStats', 'EvictionPolicy', 'POLICIES', 'enable', 'disable',
    'is_enabled', 'current_engine', 'eviction_threshold',
    'evictee_minimum_size', 'enable_sqrt_sampling'
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

    Returns:
        DTR: The active engine (its ``stats`` are live).

    Raises:
        MmdtrError: If DTR is already enabled on this thread, or a setting
            is invalid (nothing is changed then).
    """
    if is_enabled():
        raise MmdtrError('DTR is already enabled on this thread.',
                         'Call mmdtr.dtr.disable() first.')
    engine = DTR(
        eviction_threshold=eviction_threshold,
        evictee_minimum_size=evictee_minimum_size,
        enable_sqrt_sampling=enable_sqrt_sampling)
    engine.__enter__()
    _local.engine = engine
    return engine


def disable() -> DTRStats:
    """Turn DTR off for this thread and return what the engine did."""
    engine = getattr(_local, 'engine', None)
    if engine is None:
        raise MmdtrError('DTR is not enabled on this thread.',
                         'Call mmdtr.dtr.enable() first.')
    _local.engine = None
    engine.__exit__(None, None, None)
    return engine.stats


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect on this thread."""
    return getattr(_local, 'engine', None) is not None


def current_engine():
    """The engine :func:`enable` started on this thread, or ``None``."""
    return getattr(_local, 'engine', None)
