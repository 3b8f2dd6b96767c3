"""The global switches that choose a kernel's algorithm, kept for replay.

Below the dispatcher a kernel reads process-wide switches when it runs: a
CPU convolution uses oneDNN or not (``torch.backends.mkldnn.enabled``)
and, without it, NNPACK or not (``torch.backends.nnpack``),
``index_put_(accumulate=True)`` takes a sort-based kernel under
``torch.use_deterministic_algorithms(True)``, a float32 matmul may run in
reduced precision, cuDNN and cuBLAS have theirs, a parallel CPU reduction
splits its sum by the number of threads (``torch.set_num_threads``), and
flush-to-zero (``torch.set_flush_denormal``) zeroes subnormals. Another
algorithm gives other bits, so a replay runs under the switches of the
recorded call, not those of the moment (rule R4 of docs/design.md).
Switches that choose between kernels above the dispatcher (the attention
backends of ``scaled_dot_product_attention``) need nothing: the recorded op
is the kernel chosen.

Precision has two APIs. The legacy getters (``float32_matmul_precision``,
``allow_tf32``) raise once the per-backend one
(``torch.backends.<backend>.<op>.fp32_precision``) has set values they
cannot express; they read ``None`` then (not replayed). The per-backend
values, after them, are replayed, parents before children.
"""
import contextlib
from functools import partial

import torch

_C = torch._C


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


def _fp32_precisions():
    """``(getter, setter)`` of each per-backend ``fp32_precision`` this
    PyTorch has, parents (``all``) before their children."""
    get = getattr(_C, '_get_fp32_precision_getter', None)
    put = getattr(_C, '_set_fp32_precision_setter', None)
    if get is None or put is None:
        return ()
    switches = []
    for backend, op in _FP32_PRECISIONS:
        try:
            get(backend, op)
        except RuntimeError:  # not in this PyTorch
            continue
        switches.append((partial(get, backend, op), partial(put, backend, op)))
    return tuple(switches)


_DENORMAL, _ONE = 5e-324, 1.0  # module globals: never folded away


def _flush_denormal() -> bool:
    """Whether subnormals flush to zero on this thread: a float multiply
    obeys the same FPU flags as the kernels (PyTorch has no getter)."""
    return _DENORMAL * _ONE == 0.0


def _legacy_switches():
    """``(name, (getter, setter))`` of each name in ``_NAMES`` this
    PyTorch has."""
    return tuple((name, both)
                 for name, both in zip(_NAMES, map(_switch, _NAMES))
                 if both is not None)


def _set_deterministic(value):
    _C._set_deterministic_algorithms(
        value, warn_only=_C._get_deterministic_algorithms_warn_only())


_NAMES = ('mkldnn_enabled', 'mkldnn_deterministic', 'nnpack_enabled',
          'float32_matmul_precision', 'onednn_allow_tf32',
          'cpu_allow_fp16_reduced_precision_reduction')
# read on every recorded op (R1): a build without CUDA skips these
_CUDA_NAMES = ('cudnn_enabled', 'cudnn_benchmark', 'cudnn_deterministic',
               'cudnn_allow_tf32', 'cublas_allow_tf32',
               'cublas_allow_fp16_reduced_precision_reduction',
               'cublas_allow_bf16_reduced_precision_reduction',
               'cublas_allow_fp16_accumulation')
_FP32_PRECISIONS = (
    ('generic', 'all'),
    ('mkldnn', 'all'),
    ('mkldnn', 'matmul'),
    ('mkldnn', 'conv'),
    ('mkldnn', 'rnn'),
    ('cuda', 'all'),
    ('cuda', 'matmul'),
    ('cuda', 'conv'),
    ('cuda', 'rnn'),
)
if torch.cuda._is_compiled():
    _NAMES += _CUDA_NAMES
_SWITCHES = ((_C._get_deterministic_algorithms, _set_deterministic), ) + \
    tuple((_tolerant(get) if 'tf32' in name or 'precision' in name else get,
           put) for name, (get, put) in _legacy_switches()) + \
    _fp32_precisions() + \
    ((torch.get_num_threads, torch.set_num_threads),
     (_flush_denormal, torch.set_flush_denormal))
_GETTERS = tuple(get for get, _ in _SWITCHES)


def current() -> tuple:
    """The switches now, one value per switch this PyTorch has."""
    return tuple([get() for get in _GETTERS])


@contextlib.contextmanager
def switched_to(values: tuple):
    """Run with the switches at ``values`` (from :func:`current`), and put
    back those that were changed."""
    now = current()
    if now == values:
        yield
        return
    changed = [(put, then, was)
               for (_, put), then, was in zip(_SWITCHES, values, now)
               if then != was and None not in (then, was)]
    try:
        for put, then, _ in changed:
            put(*then) if isinstance(then, tuple) else put(then)
        yield
    finally:
        for put, _, was in changed:
            put(*was) if isinstance(was, tuple) else put(was)
