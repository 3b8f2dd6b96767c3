"""Eviction: the candidates, the search, and the limit in force.

The eviction half of :class:`~mmdtr.core.engine.EngineState` (one state
object per engine; this mixin only groups its methods). Rules R3, R8 and
R11 (the limit in force) and R15 (allocation failures) of docs/design.md.
"""
import math
import numbers

import torch

from .allocation_failures import (allocator_snapshot, bytes_needed,
                                  cheapest_contiguous_run, largest_free_block,
                                  planning_applies, segments_for,
                                  take_failed_request)
from .policies import policy_failed
from .torch_compat import STORAGE_OBJECT_USES

_use_count = torch._C._storage_Use_Count


def _scored(policy, score, rec, clock) -> float:
    """``score(rec, clock)`` as a float, else :func:`.policy_failed`: a
    number, as :meth:`Evictor._best` takes (a str is no score)."""
    try:
        value = score(rec, clock)
        if not isinstance(value, numbers.Real):
            raise TypeError(f'score returned {value!r}, not a number')
        return float(value)
    except Exception as error:
        raise policy_failed(policy, error) from error


def _frees_metered(device, metered) -> bool:
    """Whether evicting a storage on ``device`` lowers memory in use as
    metered on ``metered`` (which may be given without an index,
    ``'cuda'``): a CUDA device's counter sees its own storages only; the
    CPU meter counts every storage an op allocates in scope, of any device
    (R11)."""
    return metered is None or metered.type == 'cpu' or (
        device.type == metered.type and
        (metered.index is None or device.index == metered.index))


def _exclusive(rec) -> bool:
    """Only the engine's aliases and the storage's own Python object (alive
    while it is) reference it, and nothing but their Python objects holds
    the aliases (R3): an alias an unpack handed out is held by autograd
    until its node is done. ``cdata`` is None once freed, by a collection
    during a search too."""
    if rec.cdata is None or _use_count(
            rec.cdata) != len(rec.views) + STORAGE_OBJECT_USES:
        return False
    for alias in rec.views.values():
        if alias._use_count() != 1:
            return False
    return True


def _address(rec):
    """The data pointer of a resident record's storage (no reference to the
    storage outlives the call: one would be a use on PyTorch 2.4, R3)."""
    storage = rec.storage()
    return None if storage is None else storage.data_ptr()


class Evictor:
    """Chooses and evicts storages; mixed into ``EngineState``.

    Reads the state's ``candidates``, ``policy``, ``clock``, ``limit``,
    ``threshold``, ``min_size``, ``sqrt_sampling``, ``_sampler``,
    ``rebuilt``, ``classes``, ``device`` and accounting
    (``memory_in_use``); sets ``limit``, ``evictions`` and
    ``eviction_failures``, and changes ``candidates`` and ``rebuilt`` in
    place.
    """

    def _add_candidate(self, rec):
        # an empty storage frees nothing (and policies divide by its size),
        # nor does one a CUDA engine's counter does not see (a CPU tensor;
        # found by a review of the CUDA paths). The CPU meter sees all: a
        # filter on both sides left every CUDA activation resident in a
        # scope that a small CPU tensor made first had metered on CPU
        if rec.cand_index < 0 and rec.nbytes >= max(self.min_size, 1) \
                and rec.recomputable(rec.version) and (
                    rec.device == self.device or _frees_metered(
                        rec.device, self.device)):
            rec.cand_index = len(self.candidates)
            self.candidates.append(rec)

    def _drop_candidate(self, rec):
        i, last = rec.cand_index, self.candidates.pop()
        if last is not rec:
            self.candidates[i] = last
            last.cand_index = i
        rec.cand_index = -1

    def evict_until(self):
        """Evict until memory in use is within the limit in force.

        When nothing evictable is left above the threshold, the threshold is
        unreachable for now: the limit rises to the memory in use plus an
        eighth of the threshold, and follows memory down again
        (:meth:`lower_limit`). Without this, every op near an unreachable
        threshold would evict the storages needed next (thrashing; R11).
        """
        while self.memory_in_use() > self.limit:
            if not self._evict_one():
                self.eviction_failures += 1
                self.limit = self.memory_in_use() + self._slack()
                return

    def hold_limit(self, memory):
        """After an op, with ``memory`` in use (read): evict down to the
        limit in force when above it, else let a raised limit follow
        memory down (R11)."""
        if self.limit is not None and memory > self.limit:
            self.evict_until()
        elif self.limit != self.threshold:
            self.lower_limit(memory)

    def _slack(self) -> int:
        return max(self.threshold // 8, 1)

    def lower_limit(self, memory):
        """Follow memory down with a limit raised by :meth:`evict_until`:
        back to the threshold once memory is within it, else to ``memory``
        plus the same slack once memory fell more than half the threshold
        below that. Raised at a spike (a large temporary, tensors held from
        Python), the limit would otherwise let memory grow to the spike's
        level again with storages left evictable; following every small
        fall near an unreachable threshold would evict, op after op, the
        storages needed next (at ResNet-50 batch 8, 0.25x: twice the
        evictions, 1.3x the step time; R11)."""
        if memory <= self.threshold:
            self.limit = self.threshold  # reachable again
        elif memory + self._slack() + self.threshold // 2 < self.limit:
            self.limit = memory + self._slack()

    def _evict_one(self) -> bool:
        """Evict one storage, or give back what a rebuild keeps; ``False``
        when there is nothing left to do either (R4).

        While a rebuild runs, what it keeps for its reads to come (its
        memo) goes first, all of it, unless the rebuild thrashes: the
        limit was raised over an unreachable threshold (R11) and the
        rebuild has rebuilt a storage a second time. Then a candidate it
        will not read again goes first, and the memo only when no such
        candidate is evictable: there, with memory held an eighth of the
        threshold above its floor, giving the memo back first made long
        rebuilds rebuild again and again what they had just rebuilt (a
        review of 2026-11-28: 89% of Deformable DETR's 86,470 rebuilds at
        0.1 of its peak).
        """
        memo = self.rebuilt
        if memo and (self.limit == self.threshold or not self.thrashing):
            memo.clear()
            return True
        best = self._choose({id(rec) for rec, _ in memo} if memo else ())
        if best is None:
            if not memo:
                return False
            memo.clear()  # nothing else can go
            return True
        if best.cand_index >= 0:
            self._evict(best)
        # else freed during the search: a policy's score allocates, so a
        # garbage collection may free a candidate (_on_free drops it);
        # memory went down, and evict_until reads it again
        return True

    def _choose(self, kept):
        """The candidate to evict, but those whose ``id`` is in ``kept``,
        or ``None``."""
        cands = self.candidates
        n = len(cands)
        if n == 0:
            return None
        best = None
        # the sample is drawn, and the pool copied, before reading: both
        # allocate, so a garbage collection may drop candidates meanwhile
        # (_on_free, R12)
        if self.sqrt_sampling and n > 4:
            k = max(2, int(n**0.5))
            drawn = self._sampler.sample(range(n), k)
            best = self._best([cands[i] for i in drawn if i < len(cands)],
                              kept)
        if best is None:  # no sampling, or nothing exclusive sampled
            best = self._best(list(cands), kept)
        return best

    def _best(self, pool, kept):
        """The lowest-scored exclusive record of ``pool`` whose ``id`` is
        not in ``kept``, or ``None``."""
        if kept:
            pool = [rec for rec in pool if id(rec) not in kept]
        score, clock = self.policy.score, self.clock
        best, best_score = None, float('inf')
        for rec in pool:
            try:  # the policy's alone (R8)
                value = score(rec, clock)
                lower = value < best_score
            except Exception as error:
                raise policy_failed(self.policy, error) from error
            if lower and _exclusive(rec):
                best, best_score = rec, value
        return best

    def _evict_for_allocation(self, error) -> bool:
        """After a CUDA allocation failed (``error``): evict the candidates
        of a run of adjacent blocks that, once free, serves it, else one
        storage as :meth:`_evict_one` does; ``False`` when neither can
        (R15).

        While a rebuild keeps a memo, :meth:`_evict_one` decides (R4).
        """
        failed = take_failed_request(error)
        if failed is not None and not self.rebuilt:
            run = self._contiguous_run(*failed)
            if run:
                evicted = self.evictions
                for rec in run:
                    # a collection may have freed one since (R12)
                    if rec.cand_index >= 0 and _exclusive(rec):
                        self._evict(rec)
                if self.evictions > evicted:
                    return True
        return self._evict_one()

    def _contiguous_run(self, device: int, reported: int):
        """The candidates to evict for a failed request of ``reported``
        bytes on CUDA device ``device``, or ``None`` (R15)."""
        index = self.device.index
        if index is None:
            index = torch.cuda.current_device()
        if device != index or not planning_applies(index):
            return None
        score, clock, evictable = self.policy.score, self.clock, {}
        for rec in list(self.candidates):  # a collection may drop some
            if _exclusive(rec):
                address = _address(rec)
                if address is not None:
                    # two storages over one address (R14): neither goes
                    evictable[address] = (math.inf, None) if (
                        address in evictable) else (_scored(
                            self.policy, score, rec, clock), rec)
        snapshot = allocator_snapshot()
        if snapshot is None:
            return None
        stream = torch.cuda.current_stream(index).cuda_stream
        segments = segments_for(snapshot, index, stream, evictable)
        need = bytes_needed(reported, largest_free_block(segments))
        return None if need is None else cheapest_contiguous_run(
            segments, need)

    def _evict(self, rec):
        self._drop_candidate(rec)
        if self.classes:  # (R8)
            rec.join_evicted_class()
        if rec.alias_refs:  # saved handles read where the counters were
            for ref in rec.alias_refs.values():  # (R10)
                ref.dropped_version = ref.version()
            rec.alias_refs = None
        rec.views.clear()  # the storage is freed here; on_free accounts
        self.evictions += 1
