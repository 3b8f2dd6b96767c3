"""Synthetic datasets: every sample is a pure function of (seed, index).

Each sample is drawn from its own ``torch.Generator`` seeded from
``(seed, index)`` through :class:`numpy.random.SeedSequence`, so samples
do not depend on the order they are read in, on workers, or on torch's
and numpy's global RNGs (which are left untouched).
"""
from typing import Dict, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from mmdtr.errors import MmdtrError
from mmdtr.registry import DATASETS
from mmdtr.utils.value_kinds import as_items, is_integer


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A private CPU generator for sample ``index`` of a dataset seeded
    ``seed``.

    Args:
        seed (int): The dataset's seed, non-negative.
        index (int): The sample index, non-negative.

    Returns:
        torch.Generator: A freshly seeded generator.
    """
    mixed = np.random.SeedSequence([seed, index]).generate_state(
        1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed))


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not is_integer(value) or value < low:
        kind = 'non-negative' if allow_zero else 'positive'
        raise MmdtrError(
            f'{name} must be a {kind} int, got {value!r}.',
            hint=f"set the dataset's {name} to an int of {low} or more.")


class _SyntheticDataset(Dataset):
    """Length, seed and index handling shared by the synthetic datasets."""

    def __init__(self, num_samples: int, seed: int):
        _check_positive('num_samples', num_samples)
        _check_positive('seed', seed, allow_zero=True)
        self.num_samples = int(num_samples)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def _generator(self, index: int) -> torch.Generator:
        index = int(index)
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(
                f'index {index} is out of range for '
                f'{type(self).__name__} of {self.num_samples} samples')
        return sample_generator(self.seed, index)


@DATASETS.register_module()
class SyntheticImageDataset(_SyntheticDataset):
    """Random images with random class labels.

    Sample ``i`` is ``dict(inputs=image, data_samples=label)``: ``image`` a
    float32 tensor (C, H, W) of standard normal values (already
    "normalised"), ``label`` an int64 scalar tensor in ``[0, num_classes)``.
    With ``collate_fn=dict(type='default_collate')`` a batch is
    ``dict(inputs=(N, C, H, W), data_samples=(N,))``.

    Args:
        num_samples (int): Dataset length. Defaults to 1000.
        image_size (int | Sequence[int]): ``size`` or ``(height, width)``.
            Defaults to 112.
        num_classes (int): Number of classes. Defaults to 1000.
        seed (int): Seed; sample ``i`` depends on ``(seed, i)`` only.
            Defaults to 0.
        num_channels (int): Image channels. Defaults to 3.

    Examples:
        >>> train_dataloader = dict(
        ...     batch_size=8,
        ...     num_workers=0,
        ...     sampler=dict(type='InfiniteSampler', shuffle=True),
        ...     collate_fn=dict(type='default_collate'),
        ...     dataset=dict(
        ...         type='SyntheticImageDataset', num_samples=1000,
        ...         image_size=112, num_classes=1000, seed=0))
    """

    def __init__(self,
                 num_samples: int = 1000,
                 image_size: Union[int, Sequence[int]] = 112,
                 num_classes: int = 1000,
                 seed: int = 0,
                 num_channels: int = 3):
        super().__init__(num_samples, seed)
        given = image_size
        if isinstance(image_size, (int, np.integer)):
            image_size = (image_size, image_size)
        image_size = as_items(image_size)  # None, a float, a string: ()
        if len(image_size) != 2:
            raise MmdtrError(
                f'image_size must be an int or (height, width), got '
                f'{given!r}.',
                hint='give one side for square images, e.g. image_size=112, '
                'or two, e.g. image_size=(112, 96).')
        for size in image_size:
            _check_positive('image_size', size)
        _check_positive('num_classes', num_classes)
        _check_positive('num_channels', num_channels)
        self.image_size = tuple(int(size) for size in image_size)
        self.num_classes = int(num_classes)
        self.num_channels = int(num_channels)
        self.metainfo = dict(num_classes=self.num_classes)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        generator = self._generator(index)
        image = torch.randn(
            self.num_channels, *self.image_size, generator=generator)
        label = torch.randint(self.num_classes, (), generator=generator)
        return dict(inputs=image, data_samples=label)


@DATASETS.register_module()
class SyntheticTokenDataset(_SyntheticDataset):
    """Random token sequences for next-token prediction.

    Sample ``i`` draws ``seq_len + 1`` uniform token ids and returns
    ``dict(inputs=tokens[:-1], data_samples=tokens[1:])``: int64 tensors of
    shape (seq_len,), the targets being the inputs shifted by one. With
    ``collate_fn=dict(type='default_collate')`` a batch is
    ``dict(inputs=(N, seq_len), data_samples=(N, seq_len))``.

    Args:
        num_samples (int): Dataset length. Defaults to 1000.
        seq_len (int): Tokens per sample. Defaults to 128.
        vocab_size (int): Token ids are in ``[0, vocab_size)``.
            Defaults to 8192.
        seed (int): Seed; sample ``i`` depends on ``(seed, i)`` only.
            Defaults to 0.

    Examples:
        >>> train_dataloader = dict(
        ...     batch_size=8,
        ...     num_workers=0,
        ...     sampler=dict(type='InfiniteSampler', shuffle=True),
        ...     collate_fn=dict(type='default_collate'),
        ...     dataset=dict(
        ...         type='SyntheticTokenDataset', num_samples=1000,
        ...         seq_len=128, vocab_size=8192, seed=0))
    """

    def __init__(self,
                 num_samples: int = 1000,
                 seq_len: int = 128,
                 vocab_size: int = 8192,
                 seed: int = 0):
        super().__init__(num_samples, seed)
        _check_positive('seq_len', seq_len)
        _check_positive('vocab_size', vocab_size)
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        self.metainfo = dict(vocab_size=self.vocab_size)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        generator = self._generator(index)
        tokens = torch.randint(
            self.vocab_size, (self.seq_len + 1, ), generator=generator)
        return dict(inputs=tokens[:-1].clone(), data_samples=tokens[1:])
