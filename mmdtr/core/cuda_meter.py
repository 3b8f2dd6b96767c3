"""The CUDA meter: ``torch.cuda.memory_allocated``, without its flattening.

``torch.cuda.memory_allocated`` flattens and sorts the allocator's whole
statistics tree into an ordered dict on every call; read after every op,
that was most of the engine's per-op cost on a GPU (figures in
docs/benchmarks.md). The reader here takes the one counter from the nested
statistics instead (R1, R11), after checking once that it agrees with
``memory_allocated``; where it does not (another layout in another torch),
it falls back to ``memory_allocated`` itself. Like the engine that owns it,
a reader does not cross a fork.
"""
import torch


class CudaAllocatedBytes:
    """Reads ``torch.cuda.memory_allocated(device)``.

    Args:
        device (torch.device): A CUDA device; without an index, the one
            current at the first read after CUDA is initialized.
    """

    def __init__(self, device: torch.device):
        self.index = device.index
        self.read = self._first_read
        self.fast = None  # whether the nested statistics are read: unknown

    def _slow(self) -> int:
        return torch.cuda.memory_allocated(self.index)

    def _first_read(self) -> int:
        """Choose the reader once CUDA is initialized, then read."""
        if not torch.cuda.is_initialized():
            return 0  # what memory_allocated says before initialization
        if self.index is None:
            self.index = torch.cuda.current_device()
        stats, index = getattr(torch._C, '_cuda_memoryStats', None), self.index

        def fast() -> int:
            return stats(index)['allocated_bytes']['all']['current']

        try:
            self.fast = stats is not None and fast() == self._slow()
        except (KeyError, TypeError, RuntimeError):
            self.fast = False
        self.read = fast if self.fast else self._slow
        return self.read()
