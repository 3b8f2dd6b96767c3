"""The eviction half of an engine over records made by hand, for the unit
tests of the eviction choice (test_replay.py, test_allocation_failures.py).
"""
import random
import weakref

import torch

from mmdtr.core.eviction import Evictor
from mmdtr.core.policies import LRUPolicy
from mmdtr.core.records import StorageRecord


class EvictionsStub(Evictor):
    """The eviction half of an engine alone, over records made by hand."""

    def __init__(self, sqrt_sampling, limit, thrashing):
        self.candidates, self.rebuilt, self.evictions = [], None, 0
        self.policy, self.clock, self.min_size = LRUPolicy(), 100, 1
        self.sqrt_sampling, self._sampler = sqrt_sampling, random.Random(0)
        self.classes, self.threshold, self.limit = False, 2**20, limit
        self.thrashing = thrashing
        self.device = None  # metered: none yet (a test may set one)


def make_candidates(evictions, n):
    """``n`` resident, recomputable candidates of 1 KiB, used at clock 0 to
    ``n - 1``, each held only through an engine alias, as the engine holds
    them (R3), and weakly referred to as its accounting does."""
    records = []
    for clock in range(n):
        alias = torch.empty(2**10, dtype=torch.uint8)
        storage = alias.untyped_storage()
        # on the device the stub meters, as the engine's candidates are
        device = evictions.device or storage.device
        rec = StorageRecord(storage.nbytes(), device, clock)
        rec.cdata, rec.lo = storage._cdata, 0  # resident, recomputable
        rec.wref = weakref.ref(storage)
        # the engine's alias, the storage's only use but its object's (R3):
        # a storage object a test holds is one more use on PyTorch 2.4
        rec.views[None] = alias
        del alias, storage
        evictions._add_candidate(rec)
        records.append(rec)
    return records
