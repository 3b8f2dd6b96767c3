"""Synthetic datasets; importing this package registers them in
``DATASETS``."""
from .synthetic import (SyntheticImageDataset, SyntheticTokenDataset,
                        sample_generator)

__all__ = [
    'SyntheticImageDataset', 'SyntheticTokenDataset', 'sample_generator'
]
