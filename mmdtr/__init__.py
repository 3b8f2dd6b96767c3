"""mmdtr: train bigger models and batches on the GPU you already have."""
from . import adapters, datasets, dtr, models  # noqa: F401  (registration)
from .errors import MmdtrError
from .version import __version__

__all__ = ['MmdtrError', '__version__', 'dtr']
