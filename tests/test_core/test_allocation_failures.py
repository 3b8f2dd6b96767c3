"""Eviction when a CUDA allocation fails (R15): the planner of a contiguous
run over allocator layouts made by hand, and the evictor's use of it over
records made by hand (CPU storages stand in for CUDA blocks: only their
addresses are read). The CUDA run is in test_cuda.py."""
import math
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmdtr.core import allocation_failures, eviction
from mmdtr.core.allocation_failures import (bytes_needed,
                                            cheapest_contiguous_run,
                                            segments_for)
from .test_replay import _candidates, _Evictions

MiB = 2**20
FREE, HELD = -math.inf, math.inf


def _run(segments, need):
    segments = [[(size * MiB, weight, name) for size, weight, name in blocks]
                for blocks in segments]
    return cheapest_contiguous_run(segments, need * MiB)


def test_the_run_follows_the_policy_not_the_single_lowest_scores():
    # a0 and a2 score lowest, but each lies between blocks in use: evicted
    # one by one in the policy's order, both were freed and the request of
    # two blocks still failed (docs/dtr.md, "CUDA")
    fragmented = [(16, 1, 'a0'), (16, HELD, 'a1'), (16, 2, 'a2'),
                  (16, HELD, 'a3')]
    whole = [(16, 3, 'b0'), (16, 4, 'b1')]
    assert _run([fragmented, whole], 32) == ['b0', 'b1']
    # the lowest highest score wins over fewer bytes
    cheap_pair = [(16, 3, 'c0'), (16, 3, 'c1')]
    assert _run([whole, cheap_pair, [(32, 5, 'd')]], 32) == ['c0', 'c1']


def test_free_neighbours_count_and_the_fewest_bytes_go():
    assert _run([[(16, FREE, None), (16, 7, 'e'), (16, 7, 'f')]], 32) == ['e']
    # the same highest score: the shortest window
    assert _run([[(8, 1, 'g'), (32, 1, 'h'), (8, 1, 'i')]], 32) == ['h']
    assert _run([[(8, 1, 'g'), (16, 1, 'h'), (16, 1, 'i'), (8, FREE, None)]],
                32) == ['h', 'i']


@pytest.mark.parametrize(
    'segments',
    [
        [[(32, FREE, None)], [(16, 1, 'a')]],  # free memory would serve it
        [[(16, 1, 'a'), (16, HELD, 'b'), (16, 2, 'c')]],  # no run spans it
        [[(16, 1, 'a')], [(16, 2, 'b')]],  # not across segments
        [],
    ])
def test_no_run_when_none_helps(segments):
    assert _run(segments, 32) is None


def _every_window(segments, need):
    """(highest weight, bytes evicted) of the best window by brute force;
    ``None`` where free blocks alone span ``need`` or no window does."""
    best = None
    for blocks in segments:
        for i in range(len(blocks)):
            for j in range(i, len(blocks)):
                window = blocks[i:j + 1]
                if any(w == HELD for _, w, _ in window):
                    break
                if sum(size for size, _, _ in window) < need:
                    continue
                key = (max(w for _, w, _ in window),
                       sum(size for size, w, _ in window if w > FREE))
                if key[0] == FREE:
                    return None
                best = key if best is None else min(best, key)
    return best


_blocks = st.lists(
    st.tuples(
        st.integers(1, 6), st.sampled_from([FREE, HELD, 1.0, 2.0, 3.0, 4.0])),
    min_size=1,
    max_size=7)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(_blocks, max_size=4), st.integers(1, 16))
def test_the_run_is_the_best_window_by_brute_force(layout, need):
    segments, weights = [], {}
    for blocks in layout:
        segment = []
        for size, weight in blocks:
            name = None if weight in (FREE, HELD) else len(weights)
            if name is not None:
                weights[name] = (weight, size)
            segment.append((size, weight, name))
        segments.append(segment)
    run = cheapest_contiguous_run(segments, need)
    expected = _every_window(segments, need)
    if expected is None:
        assert run is None
    else:
        assert run
        highest = max(weights[n][0] for n in run)
        assert (highest, sum(weights[n][1] for n in run)) == expected


def test_the_reported_size_is_what_a_free_block_must_hold():
    assert bytes_needed(2 * MiB) is None  # a small-pool request
    assert bytes_needed(20 * MiB) == 10 * MiB  # 1 to 10 MiB: a new buffer
    assert bytes_needed(1402 * MiB) == 1402 * MiB


def _segment(blocks, **fields):
    segment = dict(
        device=0,
        address=blocks[0][0],
        segment_type='large',
        stream=0,
        is_expandable=False,
        segment_pool_id=(0, 0))
    segment.update(fields)
    segment['blocks'] = [
        dict(address=a, size=s, state=state) for a, s, state in blocks
    ]
    return segment


def test_segments_of_the_default_large_pool_on_the_stream():
    rec = object()
    evictable = {4096: (2.0, rec), 8192: (float('nan'), 'nan')}
    blocks = [(0, 4096, 'inactive'), (4096, 4096, 'active_allocated'),
              (8192, 4096, 'active_allocated'),
              (12288, 4096, 'active_pending_free')]
    kept = _segment(blocks)
    # addresses follow the sizes where a snapshot gives none
    for block in kept['blocks'][1:]:
        del block['address']
    others = [
        _segment(blocks, device=1),
        _segment(blocks, stream=7),
        _segment(blocks, segment_type='small'),
        _segment(blocks, is_expandable=True),
        _segment(blocks, segment_pool_id=(1, 0)),
    ]
    assert segments_for([kept] + others,
                        0, 0, evictable) == [[(4096, FREE, None),
                                              (4096, 2.0, rec),
                                              (4096, HELD, None),
                                              (4096, HELD, None)]]


def _layout(records, held=()):
    """One segment of the records' storages, adjacent in list order, each
    given 16 MiB; ``held``: indices of blocks in use by no candidate."""
    blocks, address = [], 0
    for i, rec in enumerate(records):
        address = rec.storage().data_ptr() if i not in held else address + 1
        blocks.append((address, 16 * MiB, 'active_allocated'))
    return _segment(blocks)


@pytest.fixture
def failed_allocation(monkeypatch):
    """Fakes a failed CUDA allocation of ``bytes`` over ``snapshot``."""

    def fail(nbytes, snapshot):
        monkeypatch.setattr(eviction, 'take_failed_request', lambda:
                            (0, nbytes))
        monkeypatch.setattr(torch.cuda, 'memory_snapshot', lambda: snapshot)
        monkeypatch.setattr(
            torch.cuda, 'current_stream',
            lambda index: type('Stream', (), dict(cuda_stream=0)))

    return fail


def _evictions(n):
    evictions = _Evictions(False, None, False)
    evictions.device = torch.device('cuda', 0)
    records = _candidates(evictions, n)
    for rec in records:  # as the engine's accounting refers to them
        rec.wref = weakref.ref(rec.views[None].untyped_storage())
    return evictions, records


def test_a_failed_allocation_evicts_the_run_that_serves_it(failed_allocation):
    evictions, records = _evictions(6)
    # LRU would evict 0 and 2 first: between blocks in use, in vain
    failed_allocation(32 * MiB, [
        _layout(records[:4], held={1, 3}),
        _layout(records[4:]),
    ])
    assert evictions._evict_for_allocation()
    assert evictions.evictions == 2
    assert [rec.cand_index < 0 for rec in records] == [False] * 4 + [True] * 2


def test_a_candidate_held_from_python_is_no_part_of_a_run(failed_allocation):
    evictions, records = _evictions(4)
    failed_allocation(32 * MiB, [_layout(records[:2]), _layout(records[2:])])
    pinned = records[0].views[None].view(-1)  # seen from Python: kept (R3)
    assert evictions._evict_for_allocation()
    assert [rec.cand_index < 0
            for rec in records] == [False, False, True, True]
    del pinned


@pytest.mark.parametrize('case', ['no run', 'small request', 'memo'])
def test_otherwise_one_storage_goes_in_the_policys_order(
        failed_allocation, case):
    evictions, records = _evictions(3)
    failed_allocation(2 * MiB if case == 'small request' else 64 * MiB,
                      [_layout(records)])
    if case == 'memo':  # a rebuild keeps a memo: R4 decides
        storage = records[0].views[None].untyped_storage()
        evictions.rebuilt = {(records[0], 0): [storage, 1]}
        failed_allocation(32 * MiB, [_layout(records)])
        assert evictions._evict_for_allocation() and not evictions.rebuilt
        assert evictions.evictions == 0
        return
    assert evictions._evict_for_allocation()
    assert evictions.evictions == 1 and records[0].cand_index < 0


def test_the_observer_notes_a_failure_once(monkeypatch):
    attached = []
    monkeypatch.setattr(allocation_failures, '_watching', [])
    monkeypatch.setattr(
        torch._C,
        '_cuda_attach_out_of_memory_observer',
        attached.append,
        raising=False)
    assert allocation_failures.watch_allocation_failures()
    assert allocation_failures.watch_allocation_failures()
    assert len(attached) == 1
    attached[0](0, 64 * MiB, 11 * 2**30, 0)
    assert allocation_failures.take_failed_request() == (0, 64 * MiB)
    assert allocation_failures.take_failed_request() is None
