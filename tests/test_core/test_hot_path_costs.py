"""Work per op that must not grow with what a scope has made (R1).

Counted, not timed. Found by an audit of the hot path (2026-11-29), which
counted the lines the engine ran per op while one dimension grew.
"""
import pytest
import torch

from mmdtr.core.saved_tensors import _alias_ref
from mmdtr.core.tracked_tensors import WeakList
from mmdtr.core.writes import Writes
from mmdtr.dtr import DTR


@pytest.fixture
def freezes(monkeypatch):
    """The number of ``Writes._freeze`` calls so far, in a list."""
    freeze, calls = Writes._freeze, [0]

    def counted(self, rec):
        calls[0] += 1
        return freeze(self, rec)

    monkeypatch.setattr(Writes, '_freeze', counted)
    return calls


@pytest.mark.parametrize('made', ['zeros', 'no_grad', 'outside'])
def test_readers_of_a_storage_written_in_turn_are_frozen_once(
        same_under_dtr, freezes, made):
    # K reads of a storage that cannot be rebuilt, each followed by a write
    # to it: each write walked every reader frozen before, K^2/2 calls
    k = 300
    outside = torch.zeros(8)

    def step():
        w = torch.randn(8, requires_grad=True)
        if made == 'zeros':
            acc = torch.zeros(8)  # a fresh buffer: not rebuildable (R5)
        elif made == 'no_grad':
            with torch.no_grad():
                acc = w * 0.0
        else:  # made before the scope
            acc = outside.zero_()
        kept = []
        for _ in range(k):
            kept.append(acc + w)
            acc.add_(1.0)
        loss = torch.stack(kept).square().sum()
        loss.backward()
        return [loss, w.grad] + kept

    same_under_dtr(step)
    assert freezes[0] <= 2 * k, freezes


def _engine_lines(fn):
    """The lines of ``mmdtr/core`` that ``fn()`` runs."""
    import os
    import sys

    import mmdtr.core
    core, lines = os.path.dirname(mmdtr.core.__file__), [0]

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(core):
            return None
        if event == 'line':
            lines[0] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return lines[0]


def _backward_lines_per_unpack(k):
    """One tensor saved by ``k`` ops, evicted and rebuilt between the
    unpacks of backward (a threshold of a few storages)."""
    a = torch.randn(256, requires_grad=True)
    ws = [torch.randn(256, requires_grad=True) for _ in range(k)]
    with DTR(eviction_threshold=1536, evictee_minimum_size=1) as engine:
        x = torch.tanh(a)
        loss = sum((x * w).sum() for w in ws)
        del x
        lines = _engine_lines(loss.backward)
    assert engine.stats.recomputations >= k - 1
    return lines / k


def test_a_storage_saved_by_many_ops_costs_the_same_per_unpack():
    # each rebuild added a link to the chain of refs every handle walked
    # from the one it saved (AliasRef.latest), and each eviction walked
    # every user ever linked (WeakList.live): 3,179, 8,876 and 31,676 lines
    # per unpack for 100, 400 and 1,600 handles
    few, many = _backward_lines_per_unpack(50), _backward_lines_per_unpack(400)
    assert many < 1.1 * few, (few, many)


class _Obj:
    pass


def test_weak_lists_drop_dead_references_when_read():
    kept, users = _Obj(), WeakList()
    for _ in range(19):
        users.add(_Obj())  # dies at once
    users.add(kept)
    assert users.any_live() and len(users) == 1
    users.add(kept)  # read twice: listed twice
    for _ in range(5):
        users.add(_Obj())
    assert users.live() == [kept] and len(users) == 2


def test_a_ref_points_to_the_latest_once_it_was_looked_up():
    alias = torch.zeros(1)
    refs = [_alias_ref(alias) for _ in range(100)]
    for ref, successor in zip(refs, refs[1:]):
        ref.successor = successor
    assert refs[0].latest() is refs[-1]
    assert refs[0].successor is refs[-1]
