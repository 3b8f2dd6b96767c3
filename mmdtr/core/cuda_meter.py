"""The CUDA meter: ``torch.cuda.memory_allocated``, read cheaply and rarely.

``torch.cuda.memory_allocated`` flattens and sorts the allocator's whole
statistics tree into an ordered dict on every call; read after every op,
that was most of the engine's per-op cost on a GPU (figures in
docs/benchmarks.md). The reader here takes the one counter (and its peak)
from the nested statistics instead, after checking once that they agree
with ``memory_allocated`` and ``max_memory_allocated``; where they do not
(another layout in another torch), it falls back to those two.

Even the nested statistics cost about 19 us a read on an H100's host, so
the engine reads only when memory could be near its limit (R11): between
reads it adds its own count of the storages ops allocate and free to the
last reading (:func:`read_guard`, :data:`READ_EVERY_OPS`). Like the engine
that owns it, a reader does not cross a fork.
"""
import torch

# The counter is read at least once every this many ops (R11): what the
# engine cannot see between reads (allocations outside the dispatcher, the
# allocator rounding blocks up) accumulates for at most this many ops.
READ_EVERY_OPS = 16
_MIN_GUARD = 64 * 2**20


def read_guard(threshold) -> int:
    """How far below its limit the engine starts reading after every op.

    Args:
        threshold (int | None): The eviction threshold in bytes.

    Returns:
        int: A sixteenth of the threshold, and at least 64 MiB: room for
        what the engine's own count misses in :data:`READ_EVERY_OPS` ops.
    """
    return max((threshold or 0) // 16, _MIN_GUARD)


class CudaAllocatedBytes:
    """Reads ``torch.cuda.memory_allocated(device)`` and tracks its peak.

    Attributes:
        peak (int): The largest ``memory_allocated`` since the first read:
            the allocator's own peak when that rose after the first read
            (so nothing between reads is missed), else the largest read.

    Args:
        device (torch.device): A CUDA device; without an index, the one
            current at the first read after CUDA is initialized.
    """

    def __init__(self, device: torch.device):
        self.index = device.index
        self._counters = self._choose
        self.fast = None  # whether the nested statistics are read: unknown
        self.peak = 0
        self._peak_before = self._peak_seen = None  # the allocator's peak

    def read(self) -> int:
        """Return ``memory_allocated`` now, and update :attr:`peak`."""
        counters = self._counters()
        if counters is None:
            return 0  # what memory_allocated says before initialization
        current, peak = counters
        if self._peak_before is None:
            self._peak_before = peak  # reached before the first read
        elif peak < self._peak_seen:
            self._peak_before = 0  # reset since: every later peak is ours
        self._peak_seen = peak
        if peak > self._peak_before and peak > self.peak:
            self.peak = peak
        if current > self.peak:
            self.peak = current
        return current

    def _slow(self):
        return (torch.cuda.memory_allocated(self.index),
                torch.cuda.max_memory_allocated(self.index))

    def _choose(self):
        """Choose the reader once CUDA is initialized, then read."""
        if not torch.cuda.is_initialized():
            return None
        if self.index is None:
            self.index = torch.cuda.current_device()
        stats, index = getattr(torch._C, '_cuda_memoryStats', None), self.index

        def fast():
            counter = stats(index)['allocated_bytes']['all']
            return counter['current'], counter['peak']

        try:
            self.fast = stats is not None and fast() == self._slow()
        except (KeyError, TypeError, RuntimeError):
            self.fast = False
        self._counters = fast if self.fast else self._slow
        return self._counters()
