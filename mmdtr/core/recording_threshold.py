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
they cannot hold. So does a step whose inputs hold more bytes than those of
every recent step that gave theirs (a larger batch or image): what its
first ops make before it passes the recent peak would be held to the end,
and a step that grows may need to evict it.
"""
from collections import deque
from typing import Mapping, Optional, Sequence

import torch

from .cost_model import tensor_bytes

#: The next step records from at most this fraction of the threshold on.
AUTO_FRACTION = 0.5
#: Steps looked back on: one that evicted among them means recording.
AUTO_WINDOW = 8


def next_recording_threshold(history: Sequence,
                             larger_inputs: bool = False) -> Optional[int]:
    """The ``recording_threshold`` for the next step of a training loop.

    Args:
        history (Sequence[DTRStats]): The statistics of the last steps that
            completed, oldest first; only the last :data:`AUTO_WINDOW`
            are read.
        larger_inputs (bool): Whether the next step's inputs hold more
            bytes than those of each of these steps. Defaults to False.

    Returns:
        int | None: The highest peak among those steps, capped at
        :data:`AUTO_FRACTION` of the last step's eviction threshold, if
        none of them evicted or failed to evict and the inputs are not
        larger; ``None`` (record from the first op) otherwise, with no
        step yet, and always without a threshold (evicting on allocation
        failure, CUDA).

    Examples:
        >>> next_recording_threshold([last_step_stats])  # or RecentSteps
    """
    recent = list(history)[-AUTO_WINDOW:]
    if larger_inputs or not recent or recent[-1].threshold is None:
        return None
    if any(s.evictions or s.eviction_failures for s in recent):
        return None
    point = min(
        max(s.peak_memory for s in recent),
        int(recent[-1].threshold * AUTO_FRACTION))
    return point if point > 0 else None


def batch_bytes(data) -> int:
    """The bytes of the tensors in ``data``, a tensor or dicts, lists and
    tuples of them (a data batch), each counted as dense
    (:func:`~mmdtr.core.cost_model.tensor_bytes`: a sparse or expanded
    tensor as its dense shape); other
    objects (data samples, arrays, strings) count nothing, and a container
    met twice counts once.

    Args:
        data: The structure.

    Returns:
        int: The sum.
    """
    total, seen, stack = 0, set(), [data]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += tensor_bytes(item)
        elif isinstance(item, (Mapping, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, Mapping) else item)
    return total


class RecentSteps:
    """The statistics of a training loop's last :data:`AUTO_WINDOW` steps,
    with the bytes of their inputs where given, and the recording threshold
    they give the next (``'auto'``).

    Examples:
        >>> steps = RecentSteps()
        >>> for batch in loader:
        ...     size = batch_bytes(batch)
        ...     with DTR(eviction_threshold='4GB',
        ...              recording_threshold=steps.next_threshold(size)) as e:
        ...         train_step(batch)
        ...     steps.add(e.stats, size)
    """

    def __init__(self):
        self.stats = deque(maxlen=AUTO_WINDOW)
        self.input_bytes = deque(maxlen=AUTO_WINDOW)

    def add(self, stats, input_bytes: Optional[int] = None) -> None:
        """Add the statistics of a step that completed.

        Args:
            stats (DTRStats): The step's engine's statistics.
            input_bytes (int, optional): The bytes of its inputs.
        """
        self.stats.append(stats)
        self.input_bytes.append(input_bytes)

    def next_threshold(self,
                       input_bytes: Optional[int] = None) -> Optional[int]:
        """:func:`next_recording_threshold` of the steps added, for a step
        whose inputs hold ``input_bytes`` (``None``: not compared).

        Args:
            input_bytes (int, optional): The bytes of the next step's
                inputs, compared with those of the steps that gave theirs.

        Returns:
            int | None: The recording threshold.
        """
        known = [size for size in self.input_bytes if size is not None]
        larger = input_bytes is not None and bool(known) and \
            input_bytes > max(known)
        return next_recording_threshold(self.stats, larger)
