"""Python's collector runs less often while an engine is active (R1).

The first generation's threshold is raised while engines are active and put
back when the last one closes, unless someone set another meanwhile; cycles
made in scope are still collected, a bounded number of allocations later.
"""
import gc
import threading
import weakref

import pytest
import torch

from mmdtr.core import collector
from mmdtr.dtr import DTR


@pytest.fixture(autouse=True)
def default_threshold():
    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    yield
    gc.set_threshold(*before)


def _step():
    w = torch.randn(16, 16, requires_grad=True)
    (w.exp() * 2).sum().backward()


def test_raised_in_scope_and_put_back():
    with DTR(eviction_threshold='1GB'):
        assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD
        _step()
    assert gc.get_threshold()[0] == 700


def test_put_back_after_an_exception():
    with pytest.raises(ZeroDivisionError):
        with DTR(eviction_threshold='1GB'):
            _step()
            1 / 0
    assert gc.get_threshold()[0] == 700


@pytest.mark.parametrize('theirs', [0, 5, 10**6])
def test_a_threshold_set_in_scope_is_kept(theirs):
    with DTR(eviction_threshold='1GB'):
        gc.set_threshold(theirs)
    assert gc.get_threshold()[0] == theirs


@pytest.mark.parametrize('before', [0, 10**6])
def test_automatic_collection_off_or_rarer_is_left_alone(before):
    gc.set_threshold(before)
    with DTR(eviction_threshold='1GB'):
        assert gc.get_threshold()[0] == before
    assert gc.get_threshold()[0] == before


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
    assert gc.get_threshold()[0] == collector.YOUNG_THRESHOLD  # other's
    leave.set()
    thread.join(10)
    assert gc.get_threshold()[0] == 700


class _Node:
    pass


def test_cycles_made_in_scope_are_collected_in_scope():
    # a long scope (dtr.enable()) must not keep its cyclic garbage for good
    collected = []
    with DTR(eviction_threshold='1GB'):
        node = _Node()
        node.self = node  # a cycle
        weakref.finalize(node, collected.append, True)
        del node
        keep = [[] for _ in range(collector.YOUNG_THRESHOLD + 1000)]
        assert collected == [True]
        del keep
