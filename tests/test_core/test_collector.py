"""Python's garbage collector and the engine (R1, R12).

The full collections' threshold is raised while engines are active and put
back when the last one closes (or is dropped without closing), unless
someone set another meanwhile; young cycles are collected as before. A
collection may run wherever the engine allocates and free a storage it
counts: closing and the eviction search must not trip over that.
"""
import gc
import random
import threading
import weakref

import pytest
import torch

from mmdtr.core import collector
from mmdtr.core.policies import LRUPolicy
from mmdtr.dtr import DTR


@pytest.fixture(autouse=True)
def default_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)
    assert collector.active_engines() == 0


def _step():
    w = torch.randn(16, 16, requires_grad=True)
    (w.exp() * 2).sum().backward()


def test_raised_in_scope_and_put_back():
    with DTR(eviction_threshold='1GB'):
        assert gc.get_threshold() == (700, 10, collector.FULL_THRESHOLD)
        _step()
    assert gc.get_threshold() == (700, 10, 10)


def test_put_back_after_an_exception():
    with pytest.raises(ZeroDivisionError):
        with DTR(eviction_threshold='1GB'):
            _step()
            1 / 0
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize('theirs', [(0, 10, 10), (700, 10, 5),
                                    (700, 10, 10**6)])
def test_thresholds_set_in_scope_are_kept(theirs):
    with DTR(eviction_threshold='1GB'):
        gc.set_threshold(*theirs)
    assert gc.get_threshold() == theirs


@pytest.mark.parametrize('before', [(0, 10, 10), (700, 10, 10**6)])
def test_automatic_collection_off_or_rarer_is_left_alone(before):
    gc.set_threshold(*before)
    with DTR(eviction_threshold='1GB'):
        assert gc.get_threshold() == before
    assert gc.get_threshold() == before


def test_put_back_when_the_last_engine_in_any_thread_closes():
    entered, leave = threading.Event(), threading.Event()

    def other():
        with DTR(eviction_threshold='1GB'):
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with DTR(eviction_threshold='1GB'):
        _step()
    assert gc.get_threshold()[2] == collector.FULL_THRESHOLD  # other's
    leave.set()
    thread.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def test_put_back_when_an_engine_is_dropped_without_closing():
    # a thread that ends under dtr.enable() never closes its engine
    def forgotten():
        DTR(eviction_threshold='1GB').__enter__()
        _step()

    thread = threading.Thread(target=forgotten)
    thread.start()
    thread.join(10)
    gc.collect()
    assert gc.get_threshold() == (700, 10, 10)


class _Node:
    pass


def test_young_cycles_are_collected_as_without_an_engine():
    collected = []
    with DTR(eviction_threshold='1GB'):
        node = _Node()
        node.self = node  # a cycle
        weakref.finalize(node, collected.append, True)
        del node
        keep = [[] for _ in range(gc.get_threshold()[0] + 100)]
        assert collected == [True]
        del keep


def test_closing_while_a_collection_frees_a_storage():
    # closing walks the records and allocates: a collection there freed a
    # storage held by cyclic garbage, and its record left the table being
    # walked ('dictionary changed size during iteration'); found by an
    # adversarial search
    x = torch.randn(8, 8)
    engine = DTR(eviction_threshold='1GB', evictee_minimum_size=1)
    engine.__enter__()
    keep = [x * i for i in range(400)]  # records to close
    node = _Node()
    node.self, node.tensor = node, x + 1  # a storage the engine counts
    del node
    # the young generation one allocation short of its threshold
    pad = [
        []
        for _ in range(max(0,
                           gc.get_threshold()[0] - gc.get_count()[0] - 2))
    ]
    engine.__exit__(None, None, None)
    assert not engine.active
    assert engine.stats.ops >= 400
    del keep, pad


class _CollectingOnce(LRUPolicy):
    """Scores as LRU; its first score runs a full collection."""

    def __init__(self):
        self.collected = False

    def score(self, record, clock):
        if not self.collected:
            self.collected = True
            gc.collect()
        return super().score(record, clock)


def test_a_candidate_freed_during_the_eviction_search():
    # the first candidate scored is saved by a graph only cyclic garbage
    # holds: the collection in its score frees it (before the fix:
    # TypeError, the search read the freed record's storage)
    policy = _CollectingOnce()
    w = torch.randn(64, 64, requires_grad=True)
    with DTR(
            eviction_threshold=20 * 1024, evictee_minimum_size=1,
            policy=policy) as engine:
        node = _Node()
        node.self, node.out = node, w.exp().sum()  # exp saves 16 KiB
        del node
        y = (torch.randn(64, 64) + 1).exp()  # over the threshold: evicts
        loss = (y * w).sum()
        loss.backward()
    assert policy.collected
    assert torch.equal(w.grad, y)
    assert engine.stats.eviction_failures > 0  # y is visible: kept


class _SamplerCollectingOnce(random.Random):
    """A sampler whose first sample() runs a collection first, as one its
    own allocations may set off."""

    collected = False

    def sample(self, population, k, **kwargs):
        if not self.collected:
            self.collected = True
            gc.collect()
        return super().sample(population, k, **kwargs)


@pytest.mark.parametrize('seed', range(10))
def test_a_candidate_freed_while_the_sample_is_drawn(seed):
    # drawn from range(n) before a collection dropped a candidate, an index
    # overran the list (IndexError for seeds 2, 7 and 8 before the fix)
    w = torch.randn(64, 64, requires_grad=True)
    with DTR(
            eviction_threshold=1 << 30,
            evictee_minimum_size=1,
            enable_sqrt_sampling=True) as engine:
        state = engine._state
        state._sampler = sampler = _SamplerCollectingOnce(seed)
        saved = [(w * (i + 1)).exp() for i in range(30)]  # candidates
        loss = sum(h.sum() for h in saved)
        del saved
        node = _Node()  # a graph only cyclic garbage holds
        node.self, node.out = node, (w * 0.5).exp().sum()
        del node
        state.threshold = state.limit = 1  # evict from the next op on
        loss = loss + (w + 1).exp().sum()
        loss.backward()
    assert sampler.collected and engine.stats.evictions > 0
