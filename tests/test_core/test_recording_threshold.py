"""Recording from a threshold on (design.md R16).

Before memory in use passes ``recording_threshold`` the engine runs ops as
they are and meters what they allocate; what they make is never evicted,
and the result is bit-identical to eager wherever recording starts.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmdtr.core.recording_threshold import (AUTO_FRACTION, AUTO_WINDOW,
                                            RecentSteps, batch_bytes,
                                            next_recording_threshold)
from mmdtr.dtr import DTR, DTRStats
from mmdtr.errors import MmdtrError
from mmdtr.utils.profiler_memory import measure_peak_memory
from .test_equivalence import ZOO
from .test_meter import _model
from .test_random_graphs import PROGRAMS, run
from .test_writes_after_scope import assert_write_refused

# (eviction threshold, recording threshold), as fractions of the peak
PAIRS = ((0.9, 0.5), (0.5, 0.25), (0.3, 0.1))


@pytest.mark.parametrize('name', sorted(ZOO))
def test_zoo_is_bit_identical_wherever_recording_starts(name, oracle):
    make, step = ZOO[name]
    torch.manual_seed(0)
    check = oracle(make(), step)
    peak = check.baseline_peak
    evicted = False
    for evict_at, record_at in PAIRS:
        stats = check.run(
            peak * evict_at, recording_threshold=int(peak * record_at))
        assert 0 < stats.idle_ops < stats.ops, stats
        evicted |= stats.evictions > 0 and stats.recomputations > 0
    assert evicted  # recorded ops were evicted and rebuilt somewhere


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    program=PROGRAMS,
    seed=st.integers(0, 2**16),
    record_at=st.integers(1, 200_000))
def test_random_graphs_are_bit_identical_wherever_recording_starts(
        program, seed, record_at):
    w0 = torch.randn(32, 32) * 0.2
    expected = run(program, seed, w0)
    rng = torch.get_rng_state()
    with DTR(
            eviction_threshold=record_at + 1,  # evict all that is recorded
            evictee_minimum_size=1,
            recording_threshold=record_at) as engine:
        got = run(program, seed, w0)
    assert torch.equal(torch.get_rng_state(), rng)
    for e, g in zip(expected, got):
        assert (e is None and g is None) or torch.equal(e, g)
    assert engine.stats.idle_ops > 0


def _chain(x, n):
    """``n`` tanh ops (each saves its output, 64 KB); the storage pointer
    of each output, kept while autograd holds it."""
    h, made = x, []
    for _ in range(n):
        h = (h * 1.0001).tanh()
        made.append(h.untyped_storage()._cdata)
    return h.sum(), made


def eager_chain(x, n):
    """The loss of ``_chain(x, n)`` without DTR, and ``x``'s gradient
    (``x.grad`` is left unset)."""
    loss, _ = _chain(x, n)
    loss.backward()
    grad, x.grad = x.grad, None
    return loss, grad


def chain_engine(size):
    """An engine over ``_chain`` of outputs of ``size`` bytes: it records
    from 8 outputs' worth on and evicts above 12."""
    return DTR(
        eviction_threshold=12 * size,
        evictee_minimum_size=1,
        recording_threshold=8 * size)


def test_what_runs_before_recording_starts_is_never_evicted():
    x = torch.randn(128, 128, requires_grad=True)
    expected, grad = eager_chain(x, 24)
    with chain_engine(128 * 128 * 4) as engine:
        loss, made = _chain(x, 24)
        # what the ops made before memory passed 8 tanh outputs' worth
        # (their products too) was metered, not recorded, and is resident
        # still; the rest was recorded, and some of it evicted
        idle = [c for c in made if c in engine._state.transients]
        assert idle == made[:len(idle)] and 4 <= len(idle) <= 8
        assert engine.stats.evictions > 0
        loss.backward()
    assert torch.equal(loss, expected) and torch.equal(x.grad, grad)
    assert 0 < engine.stats.idle_ops < engine.stats.ops


def _idle_step(model, x):
    model.zero_grad(set_to_none=True)
    with DTR(eviction_threshold=2**40, recording_threshold=2**39) as e:
        model(x).square().sum().backward()
    return e.stats


def test_meter_equals_profiler_before_recording_starts():
    """As test_meter's check of the recording engine, on the same step."""
    model, x = _model(), torch.randn(8, 16, 32, 32)
    _idle_step(model, x)  # warm-up: lazy initializations allocate
    stats, profiled = measure_peak_memory(_idle_step, model, x)
    assert stats.idle_ops == stats.ops > 0
    assert stats.peak_memory == profiled


@pytest.mark.parametrize(
    'value, text',
    [
        ('2GB', "recording_threshold='2GB' (2147483648 bytes) is not below "
         'eviction_threshold (1073741824 bytes)'),
        ('1GB', 'is not below eviction_threshold'),
        # 'auto' is the config key's and DTRHook's; the error says so
        ('auto',
         "recording_threshold='auto' is not a size: DTR takes bytes or "
         "None. 'auto' is read by the dtr config key and DTRHook"),
        ('auto', 'RecentSteps (mmdtr.core.recording_threshold)'),
        # spelt otherwise, it is not what they read either (a review)
        ('AUTO', "recording_threshold='AUTO' is not a size. Hint: Give an int"
         ),
        (True, 'recording_threshold=True'),
        # compared with 'auto' as a string only (an array raised NumPy's
        # ValueError there)
        (np.ones(3), 'recording_threshold=array([1., 1., 1.]) is not a '
         'size'),
        (-1, 'recording_threshold=-1 is negative'),
    ])
def test_bad_recording_thresholds_are_refused(value, text):
    with pytest.raises(MmdtrError, match='mmdtr: ') as info:
        DTR(eviction_threshold='1GB', recording_threshold=value)
    assert text in str(info.value)


@pytest.mark.parametrize('value', [None, 0])
def test_no_recording_threshold_records_from_the_first_op(value):
    with DTR(eviction_threshold='1GB', recording_threshold=value) as engine:
        (torch.randn(4, 4, requires_grad=True) * 2).sum().backward()
    assert engine.stats.idle_ops == 0 and engine.stats.ops > 0


def _stats(peak, threshold=1000, evictions=0, failures=0):
    return DTRStats(
        peak_memory=peak,
        evictions=evictions,
        recomputations=evictions,
        remat_seconds=0.0,
        eviction_failures=failures,
        ops=10,
        threshold=threshold)


HALF = int(1000 * AUTO_FRACTION)


@pytest.mark.parametrize(
    'history, expected',
    [
        ([], None),
        ([_stats(100, threshold=None)], None),
        ([_stats(100)], 100),  # the recent peak
        ([_stats(300), _stats(100)], 300),  # the highest recent peak
        ([_stats(HALF + 1)], HALF),  # at most half the threshold
        ([_stats(100, evictions=1)], None),
        ([_stats(100, failures=1)], None),
        ([_stats(100, evictions=1)] + [_stats(100)] * (AUTO_WINDOW - 1), None),
        ([_stats(100, evictions=1)] + [_stats(100)] * AUTO_WINDOW, 100),
        ([_stats(900)] + [_stats(100)] * AUTO_WINDOW,
         100),  # out of the window
        ([_stats(0, threshold=1)], None),
    ])
def test_next_recording_threshold(history, expected):
    assert next_recording_threshold(history) == expected
    assert next_recording_threshold(history, larger_inputs=True) is None


@pytest.mark.parametrize(
    'sizes, next_size, expected',
    [
        ([1000, 1000], 1000, 100),  # the same batch
        ([1000, 1000], 999, 100),
        ([1000, 1000], None, 100),  # not compared
        ([1000, 1000], 1001, None),  # more than every recent one: recorded
        ([1000, 3000], 2000, 100),  # not more than every one
        ([None, None], 5000, 100),  # nothing to compare with
        ([None, 1000], 1001, None),  # compared with those given
        ([5000] + [1000] * AUTO_WINDOW, 2000, None),  # out of the window
    ])
def test_recent_steps_record_larger_inputs_from_the_first_op(
        sizes, next_size, expected):
    steps = RecentSteps()
    for size in sizes:
        steps.add(_stats(100), size)
    assert steps.next_threshold(next_size) == expected


def test_batch_bytes_of_a_data_batch():
    batch = dict(
        inputs=[torch.zeros(3, 4, 4),
                torch.zeros(3, 2, 2)],
        labels=torch.zeros(2, dtype=torch.int64),
        meta=({
            'scale': 1.5,
            'mask': torch.zeros(8, dtype=torch.bool)
        }, 'name'))
    assert batch_bytes(batch) == (48 + 12) * 4 + 2 * 8 + 8
    assert batch_bytes(torch.zeros(5)) == 20 and batch_bytes('x') == 0
    # counted as dense: a sparse tensor has no nbytes (found by a review:
    # a batch holding one crashed the step)
    sparse = torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (3, 3))
    assert batch_bytes([sparse, torch.zeros(1).expand(10)]) == 36 + 40
    cyclic = {'x': torch.zeros(2)}
    cyclic['self'] = [cyclic, cyclic]
    assert batch_bytes(cyclic) == 8


def test_foreach_writes_move_version_counters_while_idle():
    """A ``_foreach_`` kernel bumps no counter below a dispatch mode: eager
    refuses the backward after it writes a saved tensor, so must DTR
    (found by a review; a foreach optimizer between two backwards)."""
    with DTR(eviction_threshold='1GB', recording_threshold='512MB') as e:
        y = torch.randn(4, requires_grad=True).exp()  # saves its output
        torch._foreach_mul_([y], 2.0)
        assert y._version == 1
        with pytest.raises(RuntimeError, match='modified by an inplace'):
            y.sum().backward()
    assert e.stats.idle_ops == e.stats.ops


@pytest.mark.parametrize('grow', ['resize_', 'out'])
def test_idle_storages_grown_after_recording_starts_are_counted_again(grow):
    big = torch.randn(1024, 1024)
    size = big.nelement() * 4

    def step():
        x = torch.zeros(16)  # idle
        y = big * 2.0  # passes the recording threshold
        if grow == 'resize_':
            x.resize_(1024, 1024)  # recorded
        else:
            torch.mul(big, 3.0, out=x)
        return x, y

    (x, y), profiled = measure_peak_memory(step)
    with DTR(eviction_threshold=4 * size, recording_threshold=size // 2) as e:
        x, y = step()
        assert e._state.in_use == 2 * size
    assert 0 < e.stats.idle_ops < e.stats.ops
    # the profiler also sees the 16 floats (and the number) inside the op
    assert 2 * size == e.stats.peak_memory <= profiled < 2 * size + 1024


def test_a_storage_set_makes_while_idle_is_counted():

    def step():
        x = torch.empty(3)
        x.set_()  # a new, empty storage
        x.resize_(1024, 1024)
        return x

    _, profiled = measure_peak_memory(step)
    with DTR(eviction_threshold='1GB', recording_threshold='512MB') as e:
        x = step()
        assert e._state.in_use == x.untyped_storage().nbytes() > 0
    assert e.stats.peak_memory == profiled
    assert e.stats.idle_ops == e.stats.ops


def test_on_cuda_recording_starts_between_counter_reads():
    """Far below the eviction threshold the CUDA counter is read every
    READ_EVERY_OPS ops (R11); the switch reads the estimate between reads,
    as on CPU (an engine of CPU ops metered as on CUDA)."""
    from .test_cuda_meter import _metered_as_cuda
    x = torch.randn(128, 128, requires_grad=True)
    size = 128 * 128 * 4
    with DTR(eviction_threshold=2**40, recording_threshold=3 * size) as e:
        meter = _metered_as_cuda(e)
        h, switched = x, None
        for i in range(12):
            h = (h * 1.0001).tanh()
            state = e._state  # not e.stats: a read of it reads the meter
            if switched is None and state.idle_ops < state.clock:
                switched = i
        h.sum().backward()
    # a step keeps its 64 KB tanh output; with the product alive while
    # tanh runs, step 2 passes 3 of them, and step 3 records (on the
    # counter alone, at its next read: step 6)
    assert switched is not None and switched <= 3
    assert len(meter.clocks) < e.stats.ops


ALIASES = dict(
    detach=lambda a: a.detach(),
    data=lambda a: a.data,
    view=lambda a: a.view(-1),
    unsafe_split=lambda a: a.unsafe_split(a.shape[0])[0],
    _unsafe_view=lambda a: torch.ops.aten._unsafe_view(a, (a.numel(), )))


@pytest.mark.parametrize(
    'alias, reader', [(alias, 'maker') for alias in sorted(ALIASES)] +
    [(alias, 'alias')
     for alias in ('view', 'unsafe_split', '_unsafe_view')])  # with grad
def test_idle_storage_written_after_the_scope_through_another_tensor(
        alias, reader):
    """A recipe reads a storage made before recording started as it is: a
    write after the scope through another tensor an op returned over it
    (the alias, or the tensor that made it), made while idle, its counter
    its own or shared, is refused as a record's is (R13), once the tensor
    the recipe read is gone (found by an adversarial review and a review
    of its fix: another gradient)."""
    n = 128
    size = n * n * 4
    x = torch.randn(n, n)
    w = torch.randn(n, n, requires_grad=True)

    def body():
        a = x @ w  # idle
        u = ALIASES[alias](a)
        read, other = (a, u) if reader == 'maker' else (u, a)
        pad = [torch.randn(n, n) for _ in range(3)]  # recording starts
        h = read.tanh()  # recorded: reads it as it is; saved, evicted
        for _ in range(6):
            h = h.sigmoid()
        return other, h.sum(), pad

    def run(use_dtr, write):
        w.grad = None
        if use_dtr:
            with DTR(
                    eviction_threshold=5 * size + 1,
                    evictee_minimum_size=1,
                    recording_threshold=3 * size) as e:
                other, loss, pad = body()
            assert 0 < e.stats.idle_ops < e.stats.ops
            assert e.stats.evictions > 0
        else:
            other, loss, pad = body()
        del pad
        if write:
            with torch.no_grad():
                other.mul_(-3.0)
        loss.backward()
        return w.grad

    assert_write_refused(run)
