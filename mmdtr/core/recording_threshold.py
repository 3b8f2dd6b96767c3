"""When a training loop's next engine starts recording (R16).

A training loop runs one engine per step. While a step stays well below the
eviction threshold, recording its ops buys nothing: nothing is evicted. The
rule below lets the next step run its ops as they are, metered, until
memory in use passes half the threshold; a step that grows past that point
records from there on, so what it allocates later can still be evicted. Any
eviction, or a peak above that point, and the next step records from its
first op again.
"""
from typing import Optional

#: The next step records from this fraction of the eviction threshold on,
#: when the last step stayed below it and evicted nothing.
AUTO_FRACTION = 0.5


def next_recording_threshold(stats) -> Optional[int]:
    """The ``recording_threshold`` for the next step of a training loop.

    Args:
        stats (DTRStats | None): The statistics of the last step that
            completed (``None``: none yet).

    Returns:
        int | None: ``AUTO_FRACTION`` of the last step's eviction threshold
        if that step evicted nothing, failed no eviction and peaked at or
        below that point; ``None`` (record from the first op) otherwise,
        and always without a threshold (evicting on allocation failure,
        CUDA).

    Examples:
        >>> engine = DTR(eviction_threshold='4GB',
        ...              recording_threshold=next_recording_threshold(
        ...                  last_stats))
    """
    if stats is None or stats.threshold is None:
        return None
    if stats.evictions or stats.eviction_failures:
        return None
    point = int(stats.threshold * AUTO_FRACTION)
    return point if 0 < point and stats.peak_memory <= point else None
