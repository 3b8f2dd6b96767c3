"""The global switches that choose a kernel's algorithm, kept for replay.

Below the dispatcher a kernel reads process-wide switches when it runs: a
CPU convolution uses oneDNN or not (``torch.backends.mkldnn.enabled``)
and, without it, NNPACK or not (``torch.backends.nnpack``),
``index_put_(accumulate=True)`` takes a sort-based kernel under
``torch.use_deterministic_algorithms(True)``, a float32 matmul or
convolution may run in reduced precision, cuDNN and cuBLAS have theirs, a
parallel CPU reduction splits its sum by the number of threads
(``torch.set_num_threads``), and flush-to-zero
(``torch.set_flush_denormal``) zeroes subnormals. Another algorithm gives
other bits, so a replay runs under the switches of the recorded call, not
those of the moment (rule R4 of docs/design.md). Switches that choose
between kernels above the dispatcher (the attention backends of
``scaled_dot_product_attention``) need nothing: the recorded op is the
kernel chosen.

Float32 precision has two APIs, both kept: the legacy flags
(``float32_matmul_precision``, ``allow_tf32``), whose getters raise (read
as ``None``, unknown) once the per-backend values
(``torch.backends.<backend>.<op>.fp32_precision``) differ in ways they
cannot express, and the per-backend values, after them. Setting one switch
may change others (a legacy flag the per-backend values and another
legacy flag, a parent precision what its unset children read):
:func:`switched_to` sets them again until all read as asked.
"""
from functools import partial
from typing import Optional

import torch

from .interrupts import interrupt_safe, put_back

_C = torch._C
# read on every recorded op (R1): a build without CUDA skips the CUDA ones
_NAMES = ('mkldnn_enabled', 'mkldnn_deterministic', 'nnpack_enabled',
          'cpu_allow_fp16_reduced_precision_reduction')
_CUDA_NAMES = ('cudnn_enabled', 'cudnn_benchmark', 'cudnn_deterministic',
               'cublas_allow_fp16_reduced_precision_reduction',
               'cublas_allow_bf16_reduced_precision_reduction',
               'cublas_allow_fp16_accumulation')
# legacy precision flags: their getters may raise (see above)
_LEGACY_PRECISIONS = ('float32_matmul_precision', 'onednn_allow_tf32')
_CUDA_LEGACY_PRECISIONS = ('cudnn_allow_tf32', 'cublas_allow_tf32')
# (backend, op), parents before their children; the CUDA ones on every
# build, since they decide what the legacy getters can read
_PRECISIONS = (('generic', 'all'), ('mkldnn', 'all'), ('mkldnn', 'matmul'),
               ('mkldnn', 'conv'), ('mkldnn', 'rnn'), ('cuda', 'all'),
               ('cuda', 'matmul'), ('cuda', 'conv'), ('cuda', 'rnn'))


def _switch(name):
    """``(getter, setter)`` of ``torch._C._get_<name>`` / ``_set_<name>``,
    or ``None`` where this PyTorch has not both."""
    get = getattr(_C, f'_get_{name}', None)
    put = getattr(_C, f'_set_{name}', None)
    return None if get is None or put is None else (get, put)


def _tolerant(get):
    """``get``, reading ``None`` where PyTorch refuses to answer."""

    def read():
        try:
            return get()
        except RuntimeError:  # a legacy precision getter after the new API
            return None

    return read


def _fp32_precisions(pairs):
    """``(getter, setter)`` of each per-backend precision in ``pairs`` this
    PyTorch has."""
    get = getattr(_C, '_get_fp32_precision_getter', None)
    put = getattr(_C, '_set_fp32_precision_setter', None)
    switches = []
    for backend, op in pairs if get and put else ():
        try:
            get(backend, op)
        except RuntimeError:  # not in this PyTorch
            continue
        switches.append((partial(get, backend, op), partial(put, backend, op)))
    return tuple(switches)


_DENORMAL, _ONE = 5e-324, 1.0  # module globals: never folded away


def flushing_denormals() -> bool:
    """Whether subnormals flush to zero on this thread: a float multiply
    obeys the same FPU flags as the kernels (PyTorch has no getter)."""
    return _DENORMAL * _ONE == 0.0


def _deterministic():
    """``(enabled, warn_only)`` of ``torch.use_deterministic_algorithms``."""
    return (_C._get_deterministic_algorithms(),
            _C._get_deterministic_algorithms_warn_only())


def _set_deterministic(enabled, warn_only):
    _C._set_deterministic_algorithms(enabled, warn_only=warn_only)


def _all_switches(cuda: Optional[bool] = None) -> tuple:
    """``(getter, setter)`` of every switch, in the order they are set;
    ``cuda``: with those of a CUDA build (default: whether this is one).
    A CPU build has the CUDA switches' getters and setters too, so tests
    build the CUDA table there."""
    if cuda is None:
        cuda = torch.cuda._is_compiled()
    names = _NAMES + (_CUDA_NAMES if cuda else ())
    legacy = _LEGACY_PRECISIONS + (_CUDA_LEGACY_PRECISIONS if cuda else ())
    legacy = tuple((_tolerant(get), put)
                   for get, put in filter(None, map(_switch, legacy)))
    precisions = _fp32_precisions(_PRECISIONS)
    return ((_deterministic, _set_deterministic), ) + \
        tuple(filter(None, map(_switch, names))) + legacy + precisions + \
        ((torch.get_num_threads, torch.set_num_threads),
         (flushing_denormals, torch.set_flush_denormal))


_SWITCHES = _all_switches()
_GETTERS = tuple(get for get, _ in _SWITCHES)


def current() -> tuple:
    """The switches now, one value per switch this PyTorch has."""
    return tuple([get() for get in _GETTERS])


def _put(values: tuple, now: tuple) -> None:
    """Set the switches that differ from ``values`` (``None`` there:
    unknown, left as is); ``now`` is what they read before (``None``:
    unreadable now, set all the same). A setter may change other switches
    (a legacy flag the per-backend values and another legacy flag, a
    parent precision what its unset children read), so the switches are
    read and set again until those known read as asked, three passes at
    most; tested for every pair of precision changes on the switches of a
    CPU and of a CUDA build, not proven for longer sequences."""
    for _ in range(3):
        pending = [(put, then)
                   for (_, put), then, was in zip(_SWITCHES, values, now)
                   if then is not None and then != was]
        if not pending:
            return
        for put, then in pending:
            put(*then) if isinstance(then, tuple) else put(then)
        now = current()


@interrupt_safe
def switched_to(values: tuple):
    """Run with the switches at ``values`` (from :func:`current`), and put
    them back as they were."""
    now = current()
    if now == values:
        yield
        return
    try:
        _put(values, now)
        yield
    finally:  # all of them, through an interrupt
        put_back(lambda: _put(now, current()))
