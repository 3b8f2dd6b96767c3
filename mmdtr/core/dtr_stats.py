"""What one engine did: :class:`DTRStats`, a frozen snapshot of an
:class:`~mmdtr.core.engine.EngineState`'s counters."""
import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class DTRStats:
    """What one engine did.

    Attributes:
        peak_memory (int): Peak of memory in use while active, in bytes (CPU:
            storages allocated in scope; CUDA: ``memory_allocated``, the
            allocator's own peak when it rose in scope).
        evictions (int): Storages evicted.
        recomputations (int): Storages rebuilt by replay.
        remat_seconds (float): Host time spent rebuilding saved tensors.
        eviction_failures (int): Times nothing evictable was left while
            memory was above the limit in force: the threshold, or, after
            a failure, memory in use plus an eighth of it (R11), so memory
            may stay above the threshold with no further failure counted.
        ops (int): The engine's clock: ops run in scope that completed
            (``set_`` included; not calls on tensor subclasses), plus ops
            replayed to rebuild storages.
        threshold (int | None): The eviction threshold in bytes.
        idle_ops (int): Ops run before recording started (the
            ``recording_threshold``; 0 without one): what they allocated
            is never evicted (R16).
    """
    peak_memory: int
    evictions: int
    recomputations: int
    remat_seconds: float
    eviction_failures: int
    ops: int
    threshold: Optional[int]
    idle_ops: int = 0


def stats_of(state) -> DTRStats:
    """The statistics of ``state`` (an ``EngineState``) now."""
    if state.cuda:
        state.memory_in_use()  # a read brings the peak up to date (R11)
    return DTRStats(
        peak_memory=state.peak,
        evictions=state.evictions,
        recomputations=state.recomputations,
        remat_seconds=state.remat_seconds,
        eviction_failures=state.eviction_failures,
        ops=state.clock,
        threshold=state.threshold,
        idle_ops=state.idle_ops)
