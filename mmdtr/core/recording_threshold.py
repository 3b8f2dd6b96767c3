"""When a training loop's next engine starts recording (R16).

A training loop runs one engine per step. While steps stay below the
eviction threshold, recording their ops buys nothing: nothing is evicted.
The rule below lets the next step run its ops as they are, metered, until
memory in use passes the highest peak of the recent steps, and no further
than half the threshold: a step like them records nothing, and one that
grows past that point records from there on, so what it makes later can
still be evicted. A step that evicted, or failed to, in the recent window
makes the next steps record from their first op: inputs whose memory
varies (multi-scale training) then pay for recording, not for a threshold
they cannot hold.
"""
from collections import deque
from typing import Optional, Sequence

#: The next step records from at most this fraction of the threshold on.
AUTO_FRACTION = 0.5
#: Steps looked back on: one that evicted among them means recording.
AUTO_WINDOW = 8


def next_recording_threshold(history: Sequence) -> Optional[int]:
    """The ``recording_threshold`` for the next step of a training loop.

    Args:
        history (Sequence[DTRStats]): The statistics of the last steps that
            completed, oldest first; only the last :data:`AUTO_WINDOW`
            are read.

    Returns:
        int | None: The highest peak among those steps, capped at
        :data:`AUTO_FRACTION` of the last step's eviction threshold, if
        none of them evicted or failed to evict; ``None`` (record from the
        first op) otherwise, with no step yet, and always without a
        threshold (evicting on allocation failure, CUDA).

    Examples:
        >>> next_recording_threshold([last_step_stats])  # or RecentSteps
    """
    recent = list(history)[-AUTO_WINDOW:]
    if not recent or recent[-1].threshold is None:
        return None
    if any(s.evictions or s.eviction_failures for s in recent):
        return None
    point = min(
        max(s.peak_memory for s in recent),
        int(recent[-1].threshold * AUTO_FRACTION))
    return point if point > 0 else None


class RecentSteps:
    """The statistics of a training loop's last :data:`AUTO_WINDOW` steps,
    and the recording threshold they give the next (``'auto'``).

    Examples:
        >>> steps = RecentSteps()
        >>> for batch in loader:
        ...     with DTR(eviction_threshold='4GB',
        ...              recording_threshold=steps.next_threshold()) as e:
        ...         train_step(batch)
        ...     steps.add(e.stats)
    """

    def __init__(self):
        self.stats = deque(maxlen=AUTO_WINDOW)

    def add(self, stats) -> None:
        """Add the statistics of a step that completed.

        Args:
            stats (DTRStats): The step's engine's statistics.
        """
        self.stats.append(stats)

    def next_threshold(self) -> Optional[int]:
        """:func:`next_recording_threshold` of the steps added."""
        return next_recording_threshold(self.stats)
