"""The backend switches a replay runs under (R4): the switches module, and
replays under DTR recorded under other switches (each of those failed
before its switch was kept)."""
import itertools
import warnings

import pytest
import torch
import torch.nn as nn

from mmdtr.core import backend_flags
from mmdtr.core.backend_flags import (_PRECISIONS, current, flushing_denormals,
                                      switched_to)

_GET = getattr(torch._C, '_get_fp32_precision_getter', None)
_SET = getattr(torch._C, '_set_fp32_precision_setter', None)


@pytest.fixture
def precision_state():
    """Every per-backend fp32 precision, put back afterwards."""
    if _GET is None:
        pytest.skip('no per-backend fp32_precision in this PyTorch')
    legacy = torch.get_float32_matmul_precision()  # state of its own
    cudnn = torch._C._get_cudnn_allow_tf32()  # a flag of its own too
    saved = [(b, o, _GET(b, o)) for b, o in _PRECISIONS]
    yield
    torch._C._set_cudnn_allow_tf32(cudnn)  # rewrites cuda conv and rnn
    torch.set_float32_matmul_precision(legacy)  # rewrites the matmuls'
    for backend, op, value in saved:
        _SET(backend, op, value)


def test_switched_to_sets_what_differs_and_puts_it_back():
    before = current()
    with torch.backends.mkldnn.flags(enabled=False):
        torch.use_deterministic_algorithms(True)
        try:
            recorded = current()
        finally:
            torch.use_deterministic_algorithms(False)
    assert recorded != before
    with switched_to(recorded):
        assert current() == recorded
        assert not torch.backends.mkldnn.is_available() or \
            not torch.backends.mkldnn.enabled
        assert torch.are_deterministic_algorithms_enabled()
    assert current() == before
    with switched_to(before):  # nothing to change
        assert current() == before


def test_switched_to_puts_back_after_an_exception():
    before = current()
    (enabled, warn_only), mkldnn = before[:2]
    recorded = ((not enabled, warn_only), not mkldnn) + before[2:]
    try:
        with switched_to(recorded):
            assert current() == recorded
            raise KeyError('in the replay')
    except KeyError:
        pass
    assert current() == before


def test_switched_to_keeps_warn_only_of_deterministic_mode():
    # recorded under use_deterministic_algorithms(True, warn_only=True), a
    # replay ran with warn_only off: an op eager only warned about raised
    before = current()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        recorded = current()
    finally:
        torch.use_deterministic_algorithms(False)
    with switched_to(recorded):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert current() == before


@pytest.mark.skipif(
    not torch.set_flush_denormal(False), reason='no flush-to-zero here')
def test_switched_to_covers_flush_to_zero_and_per_backend_precision():
    get = getattr(torch._C, '_get_fp32_precision_getter', None)
    put = getattr(torch._C, '_set_fp32_precision_setter', None)
    before = current()
    saved = get('mkldnn', 'matmul') if get else None
    try:
        torch.set_flush_denormal(True)
        if get:  # the legacy getter raises now: recording still works
            torch.backends.mkldnn.matmul.fp32_precision = 'tf32'
        recorded = current()
    finally:
        torch.set_flush_denormal(False)
        if get:
            put('mkldnn', 'matmul', saved)
    assert current() == before and not flushing_denormals()
    with switched_to(recorded):
        assert flushing_denormals()
        assert get is None or get('mkldnn', 'matmul') == 'tf32'
    assert current() == before and not flushing_denormals()


_PRECISION_CHANGES = {
    'legacy highest': lambda: torch.set_float32_matmul_precision('highest'),
    'legacy high': lambda: torch.set_float32_matmul_precision('high'),
    'legacy medium': lambda: torch.set_float32_matmul_precision('medium'),
    'generic tf32': lambda: _SET('generic', 'all', 'tf32'),
    'mkldnn none': lambda: _SET('mkldnn', 'all', 'none'),
    'mkldnn.matmul none': lambda: _SET('mkldnn', 'matmul', 'none'),
    'mkldnn.conv tf32': lambda: _SET('mkldnn', 'conv', 'tf32'),
    'cuda.matmul tf32': lambda: _SET('cuda', 'matmul', 'tf32'),
    'cublas tf32': lambda: torch._C._set_cublas_allow_tf32(True),
    'cudnn no tf32': lambda: torch._C._set_cudnn_allow_tf32(False),
}
# On a CUDA build cuDNN's legacy flag, off under a generic TF32 precision,
# reads as unknown (the per-backend values say TF32), so it is left as it
# is and reads True after a replay that set it; only that getter answers
# otherwise: the per-backend values, which convolutions read, are restored
_UNKNOWN_LEGACY_FLAG = {('generic tf32', 'cudnn no tf32'),
                        ('cudnn no tf32', 'generic tf32')}


@pytest.fixture(params=['this build', 'cuda build'])
def switches(request, monkeypatch):
    """Whether the switch table is a CUDA build's: that of this build, or
    that of a CUDA build (two more legacy precisions, cuDNN's and cuBLAS's
    TF32 flags, whose getters and setters a CPU build has too)."""
    if request.param == 'cuda build':
        table = backend_flags._all_switches(cuda=True)
        monkeypatch.setattr(backend_flags, '_SWITCHES', table)
        monkeypatch.setattr(backend_flags, '_GETTERS',
                            tuple(get for get, _ in table))
        return True
    return torch.cuda._is_compiled()


@pytest.mark.parametrize('first, second',
                         list(itertools.permutations(_PRECISION_CHANGES, 2)))
def test_switched_to_restores_precisions_a_setter_also_changed(
        precision_state, switches, first, second):
    # the legacy setter also rewrites per-backend values, and a parent what
    # its children read: a value equal before and after the replay was
    # overwritten by another's setter and left changed (TF32 matmuls
    # afterwards). On a CUDA build cuBLAS's legacy TF32 setter rewrites the
    # matmul precision, which then reads as unknown until it is set again
    # (seen on an H100 machine: 'medium' was left 'high' after a replay)
    recorded = current()
    _PRECISION_CHANGES[first]()
    _PRECISION_CHANGES[second]()
    now = current()
    with switched_to(recorded):
        assert current() == recorded
    if switches and (first, second) in _UNKNOWN_LEGACY_FLAG:
        assert [(a, b) for a, b in zip(current(), now) if a != b] == \
            [(True, None)]
    else:
        assert current() == now


@pytest.mark.parametrize('switch', ['mkldnn', 'nnpack', 'deterministic'])
def test_replays_run_under_the_backend_switches_of_the_call(
        same_under_dtr, switch):
    # kernels read process-wide switches: a CPU convolution uses oneDNN or
    # not (and, without it, NNPACK or not), index_put_(accumulate=True)
    # takes a sort-based kernel in deterministic mode; a replay under the
    # switches of the moment computed the saved tensors with another
    # algorithm (other bits)
    conv = nn.Conv2d(16, 32, 3, padding=1)
    conv2 = nn.Conv2d(32, 32, 3, padding=1)
    x = torch.randn(16, 16, 20, 20)

    def forward():
        if switch in ('mkldnn', 'nnpack'):
            with torch.backends.mkldnn.flags(enabled=False), \
                    torch.backends.nnpack.flags(enabled=switch == 'mkldnn'):
                h = conv(x).relu()
                return conv2(h)  # saves h
        torch.use_deterministic_algorithms(True)
        try:
            index = torch.randint(0, 64, (20000, ))
            values = conv(x).flatten(1)[:, :64].repeat(1250, 1)
            z = torch.zeros(64, 64).index_put((index, ),
                                              values,
                                              accumulate=True)
        finally:
            torch.use_deterministic_algorithms(False)
        return z.tanh()  # saves its output

    def step():
        conv.zero_grad()
        loss = forward().pow(2).sum()  # pow saves its input
        torch.ones(1 << 21).exp()  # above the peak: the saved output goes
        loss.backward()
        return [loss, conv.weight.grad, conv.bias.grad]

    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # mkldnn.flags on TF32 (torch's)
        assert same_under_dtr(step).recomputations > 0


def test_replays_run_with_the_thread_count_of_the_call(same_under_dtr):
    # a parallel reduction splits its work by the number of threads, so a
    # sum recorded on one thread and rebuilt on two gave other bits
    x = torch.randn(256, 4096)  # 2^20 elements: split across threads
    w = torch.randn(4096, requires_grad=True)
    threads = torch.get_num_threads()

    def step():
        w.grad = None
        torch.set_num_threads(1)
        try:
            s = (x * w).sum()  # one big reduction over all elements
            h = (s / 1e3).exp()  # exp saves its output, rebuilt from s
            loss = h.exp()
            del s, h  # now only the engine holds them
            torch.ones(1 << 21).exp()  # above the peak: they are evicted
        finally:
            torch.set_num_threads(2)
        try:
            loss.backward()
        finally:
            torch.set_num_threads(threads)
        return [loss, w.grad]

    assert same_under_dtr(step).recomputations > 0


def test_replays_run_under_the_flush_to_zero_of_the_call(same_under_dtr):
    # torch.set_flush_denormal zeroes subnormal results: a product recorded
    # with it on and rebuilt with it off gave other bits
    w = torch.ones(64, requires_grad=True)
    x = torch.full((64, ), 1e-20)

    def step():
        w.grad = None
        try:
            torch.set_flush_denormal(True)
            m = (x * 1e-19) * w  # x * 1e-19 is subnormal: 0; mul saves it
            torch.set_flush_denormal(False)
            torch.ones(1 << 21).exp()  # above the peak: it is evicted
            loss = m.sum()
            loss.backward()
        finally:
            torch.set_flush_denormal(False)
        return [loss, w.grad]

    if not torch.set_flush_denormal(False):
        pytest.skip('no flush-to-zero on this CPU')
    assert same_under_dtr(step).recomputations > 0


@pytest.mark.parametrize('backend', ['mkldnn', 'cuda'])
def test_recording_survives_the_per_backend_precision_api(
        same_under_dtr, precision_state, backend):
    # once a per-backend precision is set, torch's legacy getter
    # (float32_matmul_precision) raises: every recorded op raised with it
    # (that a replay restores these values is tested above)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(256, 64)
    matmul = getattr(torch.backends, backend).matmul

    def step():
        w.grad = None
        matmul.fp32_precision = 'tf32'
        h = (x @ w).tanh()  # tanh saves its output, mm its input
        loss = (h @ w).sum()
        del h  # now only autograd holds it
        torch.ones(1 << 21).exp()  # above the peak: it is evicted
        matmul.fp32_precision = 'ieee'
        loss.backward()
        return [loss, w.grad]

    assert same_under_dtr(step).recomputations > 0
