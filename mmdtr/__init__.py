"""mmdtr: train bigger models and batches on the GPU you already have.

The engine (:mod:`mmdtr.dtr`, :mod:`mmdtr.core`) and the techniques
(:mod:`mmdtr.techniques`) import torch only. Where MMEngine is installed,
importing mmdtr also registers its hooks, wrappers, runner, models and
datasets (``custom_imports=dict(imports=['mmdtr'])``); without it, the
engine and the techniques work as a plain PyTorch library.
"""
from . import dtr
from .errors import MmdtrError
from .version import __version__

try:
    import mmengine  # noqa: F401
except ModuleNotFoundError as error:  # torch only: the engine alone
    if error.name != 'mmengine':
        raise
else:
    from . import adapters, datasets, models  # noqa: F401  (registration)

__all__ = ['MmdtrError', '__version__', 'dtr']
