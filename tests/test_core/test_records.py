"""Unit tests of the recipe graph's small structures (no autograd)."""
import gc

import torch

from mmdtr.core.records import StorageRecord
from mmdtr.core.tracked_tensors import WeakList


def _record():
    return StorageRecord(16, torch.device('cpu'), 0)


def test_user_refs_give_live_users_once():
    users, a, b = WeakList(), _record(), _record()
    users.add(a)
    users.add(b)
    users.add(a)  # a recipe reading the storage twice
    assert users.live() == [a, b]
    del a
    gc.collect()
    assert users.live() == [b]


def test_user_refs_stay_short_when_users_come_and_go():
    # a storage read once per iteration of a long scope: its users die
    users, keep = WeakList(), _record()
    users.add(keep)
    for _ in range(1000):
        users.add(_record())
    assert users.live() == [keep]
    assert len(users) <= 16


def test_user_refs_adding_is_amortized_linear():
    # many live users: the list is pruned only when it has doubled
    users, records = WeakList(), [_record() for _ in range(1000)]
    prunes = 0
    for rec in records:
        before = len(users)
        users.add(rec)
        prunes += len(users) != before + 1
    assert prunes == 0 and len(users) == 1000
    assert users.live() == records


def test_a_record_whose_users_all_died_has_none():
    # a storage freed with only dead readers joined DTR's evicted classes
    # and raised its live neighbours' e* (the list of references is not
    # empty then)
    rec, user = _record(), _record()
    user.add_input(rec)
    assert rec.has_live_users()
    del user
    gc.collect()
    assert rec.users and not rec.has_live_users()
