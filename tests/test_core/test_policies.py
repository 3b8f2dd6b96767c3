"""Unit tests of the eviction policies on small synthetic graphs.

No autograd and no engine: records are built by hand, and the policy is a
pure function of a record and the clock.
"""
import pytest
import torch

from mmdtr.core import records
from mmdtr.core.policies import (POLICIES, DTRPolicy, EvictionPolicy,
                                 LargestFirstPolicy, LocalDTRPolicy, LRUPolicy,
                                 build_policy)
from mmdtr.core.records import StorageRecord
from mmdtr.errors import MmdtrError


def record(nbytes, cost, last_access, resident=True):
    rec = StorageRecord(nbytes, torch.device('cpu'), last_access)
    rec.cost = cost
    rec.cdata = 1 if resident else None
    return rec


def chain(*records):
    """Link records as a chain a -> b -> c (b's recipe reads a, ...)."""
    for a, b in zip(records, records[1:]):
        b.add_input(a)


@pytest.mark.parametrize('policy_cls', [DTRPolicy, LocalDTRPolicy])
def test_dtr_prefers_cheap_large_stale_storages(policy_cls):
    # dtr_local too: it drops only the neighbourhood (its staleness term
    # could go unnoticed: mutation testing)
    policy, clock = policy_cls(), 100
    cheap = record(1000, 10.0, 90)
    costly = record(1000, 1000.0, 90)
    small = record(10, 10.0, 90)
    fresh = record(1000, 10.0, 100)
    scores = {
        n: policy.score(r, clock)
        for n, r in dict(cheap=cheap, costly=costly, small=small,
                         fresh=fresh).items()
    }
    assert min(scores, key=scores.get) == 'cheap'
    assert scores['cheap'] < scores['costly']
    assert scores['cheap'] < scores['small']
    assert scores['cheap'] < scores['fresh']


def test_dtr_penalizes_storages_already_recomputed():
    policy = DTRPolicy(recompute_penalty=1.0)
    a, b = record(1000, 10.0, 0), record(1000, 10.0, 0)
    b.remat_count = 3
    assert policy.score(b, 10) == pytest.approx(4 * policy.score(a, 10))


def test_evicted_neighbourhood_uses_union_find_classes():
    a, b, c, d = (record(100, cost, 0) for cost in (1.0, 2.0, 4.0, 8.0))
    chain(a, b, c, d)
    assert c.evicted_neighborhood_cost() == 0
    for rec in (b, d):  # evict b, then d: two separate classes around c
        rec.cdata = None
        rec.join_evicted_class()
    assert c.evicted_neighborhood_cost() == 2.0 + 8.0
    c.cdata = None
    c.join_evicted_class()  # c joins b and d into one class
    assert b.evicted_class.root() is d.evicted_class.root()
    assert a.evicted_neighborhood_cost() == 2.0 + 4.0 + 8.0
    local = LocalDTRPolicy()
    assert local.score(a, 10) < DTRPolicy().score(a, 10)


def _chain_with_class_b_c_d():
    """Records a -> b -> c -> d -> e costing 1, 2, 4, 8 and 16, with b, c
    and d evicted: one class."""
    a, b, c, d, e = (
        record(100, cost, 0) for cost in (1.0, 2.0, 4.0, 8.0, 16.0))
    chain(a, b, c, d, e)
    for rec in (b, c, d):
        rec.cdata = None
        rec.join_evicted_class()
    return a, b, c, d, e


def test_rebuilt_storage_splits_its_evicted_class():
    a, b, c, d, e = _chain_with_class_b_c_d()
    assert a.evicted_neighborhood_cost() == 2.0 + 4.0 + 8.0
    c.cdata = 1  # c is rebuilt: b and d are no longer connected
    c.leave_evicted_class()
    assert c.evicted_class is None
    assert b.evicted_class.root() is not d.evicted_class.root()
    assert a.evicted_neighborhood_cost() == 2.0
    assert e.evicted_neighborhood_cost() == 8.0
    assert c.evicted_neighborhood_cost() == 2.0 + 8.0
    c.cdata = None  # evicted again: one class, costs counted once
    c.join_evicted_class()
    assert a.evicted_neighborhood_cost() == 2.0 + 4.0 + 8.0
    b.cdata = 1
    b.leave_evicted_class()
    assert a.evicted_neighborhood_cost() == 0
    assert e.evicted_neighborhood_cost() == 4.0 + 8.0


def test_a_chain_end_or_a_large_class_only_loses_the_rebuilt_cost(monkeypatch):
    # re-forming the class on every rebuild was quadratic along a chain
    # (found by an adversarial search): an end of the chain cannot split
    # it, and a class above SPLIT_AT_MOST members is kept whole
    a, b, c, d, e = _chain_with_class_b_c_d()
    b.cdata = 1  # an end of the chain is rebuilt: c-d stays one class
    b.leave_evicted_class()
    assert c.evicted_class.root() is d.evicted_class.root()
    assert a.evicted_neighborhood_cost() == 0
    assert b.evicted_neighborhood_cost() == e.evicted_neighborhood_cost() \
        == 4.0 + 8.0
    b.cdata = None
    b.join_evicted_class()
    monkeypatch.setattr(records, 'SPLIT_AT_MOST', 2)
    c.cdata = 1  # the middle of a class of 3 > 2: not split, as DTR's
    c.leave_evicted_class()  # union-find keeps it, its cost exact
    assert b.evicted_class.root() is d.evicted_class.root()
    assert a.evicted_neighborhood_cost() == 2.0 + 8.0


def test_a_class_merged_while_a_rebuilt_member_leaves_it(monkeypatch):
    # a garbage collection during the neighbour walk may free a storage
    # whose users then join the classes (fake deletion, R12): the class
    # being left was merged into a larger one, which loses the cost
    a, b, c, d, e = _chain_with_class_b_c_d()
    others = [record(100, 32.0, 0) for _ in range(4)]
    chain(*others)
    for rec in others:
        rec.cdata = None
        rec.join_evicted_class()
    larger = others[0].evicted_class.root()
    walk = StorageRecord.evicted_neighbours

    def merging_walk(rec):
        if rec is c:
            larger.merge(b.evicted_class.root())
        return walk(rec)

    monkeypatch.setattr(StorageRecord, 'evicted_neighbours', merging_walk)
    c.cdata = 1
    c.leave_evicted_class()
    assert b.evicted_class.root() is larger
    assert larger.cost == 4 * 32.0 + 2.0 + 8.0


def test_lru_and_largest_first():
    old, new = record(10, 1.0, 1), record(10, 1.0, 5)
    assert LRUPolicy().score(old, 9) < LRUPolicy().score(new, 9)
    big, small = record(1000, 1.0, 1), record(10, 1.0, 1)
    assert LargestFirstPolicy().score(big, 9) < \
        LargestFirstPolicy().score(small, 9)


def test_policies_are_pure():
    rec = record(1000, 10.0, 3)
    before = (rec.nbytes, rec.cost, rec.last_access, rec.remat_count)
    for cls in POLICIES.values():
        cls().score(rec, 7)
        cls().score(rec, 7)
    assert (rec.nbytes, rec.cost, rec.last_access, rec.remat_count) == before


def test_build_policy_accepts_names_and_instances():
    assert isinstance(build_policy('lru'), LRUPolicy)
    custom = LargestFirstPolicy()
    assert build_policy(custom) is custom
    with pytest.raises(MmdtrError, match="policy='mru'"):
        build_policy('mru')
    with pytest.raises(NotImplementedError):
        EvictionPolicy().score(record(1, 1.0, 0), 0)
