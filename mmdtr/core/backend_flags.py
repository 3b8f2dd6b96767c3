"""The global switches that choose a kernel's algorithm, kept for replay.

Below the dispatcher a kernel reads process-wide switches when it runs: a
CPU convolution uses oneDNN or not (``torch.backends.mkldnn.enabled``)
and, without it, NNPACK or not (``torch.backends.nnpack``),
``index_put_(accumulate=True)`` takes a sort-based kernel under
``torch.use_deterministic_algorithms(True)``, a float32 matmul may run in
reduced precision, cuDNN and cuBLAS have theirs, and a parallel CPU
reduction splits its sum by the number of threads
(``torch.set_num_threads``). Another algorithm gives
other bits, so a replay runs under the switches of the recorded call, not
those of the moment (rule R4 of docs/design.md). Switches that choose
between kernels above the dispatcher (the attention backends of
``scaled_dot_product_attention``) need nothing: the recorded op is the
kernel chosen.
"""
import contextlib

import torch

_C = torch._C


def _switch(name):
    """``(getter, setter)`` of ``torch._C._get_<name>`` / ``_set_<name>``,
    or ``None`` where this PyTorch has not both."""
    get = getattr(_C, f'_get_{name}', None)
    put = getattr(_C, f'_set_{name}', None)
    return None if get is None or put is None else (get, put)


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
if torch.cuda._is_compiled():
    _NAMES += _CUDA_NAMES
_SWITCHES = ((_C._get_deterministic_algorithms, _set_deterministic), ) + \
    tuple(filter(None, map(_switch, _NAMES))) + \
    ((torch.get_num_threads, torch.set_num_threads), )
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
