"""Long chains of ops: rebuilt without recursion along the chain (R6) and
freed as PyTorch frees them (R10), so no limit of Python's stack or of a
thread's C stack on their length."""
import gc
import os
import subprocess
import sys
import textwrap
import types

import torch

from mmdtr.dtr import DTR, EvictionPolicy
from mmdtr.errors import MmdtrError


class _EvictInForwardOnly(EvictionPolicy):
    """Least recently used while ``on``; nothing evicted after, so that a
    backward rebuilds the chain once, not once per saved tensor."""
    name = 'evict_in_forward_only'
    uses_evicted_classes = False

    def __init__(self):
        self.on = True

    def score(self, record, clock):
        return float(record.last_access) if self.on else float('inf')


def _chain(w, links):
    x = w * 1.0
    for _ in range(links):
        x = x.sin() * 1.01
    return x.sum()


def test_a_chain_deeper_than_pythons_stack_rebuilds_exactly():
    # 4200 ops evicted in forward: the first unpack rebuilds them all; by
    # recursion this was an MmdtrError ("deeper than Python's stack")
    w = torch.randn(16, requires_grad=True)
    (ref, ) = torch.autograd.grad(_chain(w, 2100), w)
    policy = _EvictInForwardOnly()
    limit = sys.getrecursionlimit()
    with DTR(
            eviction_threshold=1, evictee_minimum_size=1,
            policy=policy) as engine:
        loss = _chain(w, 2100)
        policy.on = False
        (grad, ) = torch.autograd.grad(loss, w)
    assert torch.equal(grad, ref)
    assert engine.stats.recomputations >= 4000
    assert sys.getrecursionlimit() == limit


def _rebuilds_alive():
    """Frames of the engine's rebuilds still alive (in a traceback)."""
    return [
        o for o in gc.get_objects() if isinstance(o, types.FrameType)
        and o.f_code.co_filename.endswith(os.path.join('core', 'replay.py'))
    ]


def test_an_error_at_the_bottom_of_a_chain_reaches_the_caller():
    # the first recipe of a 600-op chain read x, written after the scope:
    # the rebuild that reads it raises, under 600 rebuilds waiting for it;
    # they are closed, and nothing is left in a reference cycle
    x, w = torch.randn(16), torch.randn(16, requires_grad=True)
    policy = _EvictInForwardOnly()
    with DTR(eviction_threshold=1, evictee_minimum_size=1, policy=policy):
        loss = _chain(w * x, 300)
        policy.on = False
    x.add_(1.0)  # after the scope: seen through its version counter (R13)
    gc.disable()  # a cycle would keep them: seen without a collection
    try:
        try:
            loss.backward()
        except MmdtrError as e:
            message = str(e)
        del loss
        left = len(_rebuilds_alive())
    finally:
        gc.enable()
    assert 'written in place' in message
    assert left == 0
    with DTR(eviction_threshold=1, evictee_minimum_size=1) as engine:
        _chain(w * x, 20).backward()  # another engine rebuilds as before
    assert engine.stats.recomputations > 0


_SMALL_STACK = textwrap.dedent('''
    import threading
    import torch
    from mmdtr.dtr import DTR
    from tests.test_core.test_long_chains import (_EvictInForwardOnly,
                                                   _chain)
    threading.stack_size(256 * 1024)
    w = torch.randn(16, requires_grad=True)
    (ref, ) = torch.autograd.grad(_chain(w, 400), w)
    out = []

    def work():
        policy = _EvictInForwardOnly()
        with DTR(eviction_threshold=1, evictee_minimum_size=1,
                 policy=policy) as engine:
            loss = _chain(w, 400)
            policy.on = False
            out.append(torch.autograd.grad(loss, w)[0])
        out.append(engine.stats.recomputations)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert torch.equal(out[0], ref)
    assert out[1] >= 750, out[1]
    print('rebuilt', out[1])
''')


def _run_on_a_small_stack(script):
    done = subprocess.run([sys.executable, '-c', script],
                          capture_output=True,
                          text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_deep_chain_rebuilds_on_a_thread_with_a_small_stack():
    # by recursion, an 800-op chain overflowed a 256 KiB C stack (macOS
    # gives secondary threads 512 KiB): the process crashed
    assert 'rebuilt' in _run_on_a_small_stack(_SMALL_STACK)


_FREED_ON_A_SMALL_STACK = textwrap.dedent('''
    import threading
    import torch
    from mmdtr.dtr import DTR
    threading.stack_size(256 * 1024)
    done = []

    def work():
        w = torch.randn(16, requires_grad=True)
        with DTR(eviction_threshold='1GB'):
            x = w * 1.0
            for _ in range(3000):
                x = x.clone()
                x.mul_(1.0001)  # an in-place write the engine checks
                x = x.sin()
        del x  # the graph of 9000 nodes goes
        done.append(True)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert done  # an exception in the thread would not fail the process
    print('freed')
''')


def test_a_long_graph_is_freed_on_a_thread_with_a_small_stack():
    # the engine read grad_fn of each tensor written in place: the Python
    # object made for a node lives as long as the node, and PyTorch then
    # freed the chain of nodes by recursion, which overflowed the stack
    # (eager, without the engine, frees it; found 2026-11-27)
    assert 'freed' in _run_on_a_small_stack(_FREED_ON_A_SMALL_STACK)
