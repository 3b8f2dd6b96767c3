"""Let MMEngine checkpoints load under ``torch.load(weights_only=True)``.

Since PyTorch 2.6, :func:`torch.load` defaults to ``weights_only=True``.
MMEngine 0.10.7 calls :func:`torch.load` without ``weights_only``, so
``resume`` and ``load_from`` fail: the checkpoint's ``message_hub`` holds
:class:`~mmengine.logging.HistoryBuffer` objects, which hold numpy arrays,
and its runtime info holds numpy scalars.

Instead of turning ``weights_only`` off, mmdtr allowlists exactly the
globals that a checkpoint saved by MMEngine's Runner needs, found by saving
a real checkpoint and loading it with ``weights_only=True``:

- ``mmengine.logging.history_buffer.HistoryBuffer``;
- ``numpy.ndarray``, ``numpy.dtype`` and ``numpy._core.multiarray``'s
  ``_reconstruct`` and ``scalar`` (also under their numpy 1.x names
  ``numpy.core.multiarray.*``), which rebuild arrays and scalars;
- the dtype classes of numpy's bool and fixed-size numeric types (e.g.
  ``numpy.dtypes.Float64DType``), which the unpickler must be allowed to
  build;
- ``builtins.getattr``, but only as a restricted stand-in: a
  ``HistoryBuffer`` pickles its statistics methods as
  ``getattr(HistoryBuffer, 'mean')``, so the stand-in returns the
  statistics methods registered on ``HistoryBuffer`` and refuses anything
  else. The real :func:`getattr` is never allowlisted.

The globals are registered when :mod:`mmdtr` is imported (this module is
imported by :mod:`mmdtr.adapters`) and again, idempotently, by mmdtr's
runner.
"""
from typing import Any, Callable, List, Tuple, Union

import numpy as np
import torch
from mmengine.logging import HistoryBuffer
from torch.torch_version import TorchVersion

from mmdtr.errors import MmdtrError

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct, scalar
except ImportError:  # pragma: no cover  (numpy 1.x)
    from numpy.core.multiarray import _reconstruct, scalar

SafeGlobal = Union[Callable, Tuple[Callable, str]]

#: numpy types whose dtype classes may appear in an MMEngine checkpoint.
_NUMPY_TYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                np.uint16, np.uint32, np.uint64, np.float16, np.float32,
                np.float64)
#: whether ``torch.load`` defaults to ``weights_only=True`` (PyTorch >= 2.6)
WEIGHTS_ONLY_BY_DEFAULT = TorchVersion(torch.__version__) >= (2, 6)
#: statistics methods that every ``HistoryBuffer`` registers.
_DEFAULT_STATISTICS = ('min', 'max', 'current', 'mean')


def history_buffer_getattr(obj: Any, name: str) -> Callable:
    """Restricted ``getattr`` used when unpickling a ``HistoryBuffer``.

    Args:
        obj (Any): Must be :class:`~mmengine.logging.HistoryBuffer`.
        name (str): The name of one of its registered statistics methods,
            e.g. ``'mean'``.

    Returns:
        Callable: The statistics method.

    Raises:
        MmdtrError: For any other object or attribute.
    """
    allowed = set(_DEFAULT_STATISTICS).union(HistoryBuffer._statistics_methods)
    if obj is HistoryBuffer and isinstance(name, str) and name in allowed:
        method = vars(HistoryBuffer).get(name)
        if callable(method):
            return method
    raise MmdtrError(
        f'refusing getattr({obj!r}, {name!r}) while loading a checkpoint '
        'with weights_only=True: only the statistics methods of '
        f'HistoryBuffer ({sorted(allowed)}) are allowed.',
        hint='load the file with weights_only=False only if you trust it.')


def checkpoint_safe_globals() -> List[SafeGlobal]:
    """Return the globals that MMEngine checkpoints need.

    Returns:
        list: Entries for :func:`torch.serialization.add_safe_globals`.

    Examples:
        >>> import torch
        >>> from mmdtr.adapters.checkpoint_loading import (
        ...     checkpoint_safe_globals)
        >>> # PyTorch >= 2.6
        >>> with torch.serialization.safe_globals(checkpoint_safe_globals()):
        ...     ckpt = torch.load('work_dirs/x/iter_2.pth', weights_only=True)
    """
    safe: List[SafeGlobal] = [HistoryBuffer, np.ndarray, np.dtype]
    for module in ('numpy._core.multiarray', 'numpy.core.multiarray'):
        safe.append((_reconstruct, f'{module}._reconstruct'))
        safe.append((scalar, f'{module}.scalar'))
    safe.extend(type(np.dtype(t)) for t in _NUMPY_TYPES)
    safe.append((history_buffer_getattr, 'builtins.getattr'))
    return safe


def register_checkpoint_safe_globals() -> None:
    """Allowlist :func:`checkpoint_safe_globals` for ``weights_only`` loads.

    Idempotent: registering twice leaves the allowlist unchanged. Done on
    PyTorch >= 2.6 only, where ``torch.load`` defaults to
    ``weights_only=True``: older releases load MMEngine's checkpoints as
    they are, and PyTorch 2.4's allowlist takes no ``(object, name)``
    entries (one there broke every ``weights_only`` load of the process).
    """
    if WEIGHTS_ONLY_BY_DEFAULT:
        torch.serialization.add_safe_globals(checkpoint_safe_globals())


register_checkpoint_safe_globals()
