"""Single Path One-Shot (SPOS) supernet over ShuffleNetV2 choice blocks."""
import random
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODELS
from .arguments import (as_items, check_positive_ints, check_probability,
                        is_integer, is_real)
from .base_classifier import (BaseImageClassifier, LinearClsHead,
                              init_conv_bn_linear)
from .shufflenet_v2 import ShuffleUnit, conv_bn

#: choice name -> ShuffleUnit keyword arguments
SPOS_CHOICES = {
    'shuffle_3x3': dict(kernel_size=3),
    'shuffle_5x5': dict(kernel_size=5),
    'shuffle_7x7': dict(kernel_size=7),
    'shuffle_xception': dict(kernel_size=3, xception=True),
}


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round ``value`` to the nearest multiple of ``divisor`` (>= divisor)."""
    return max(divisor, int(value + divisor / 2) // divisor * divisor)


def _positive_ints(values) -> Optional[Tuple[int, ...]]:
    """``values`` as a non-empty tuple of ints of 1 or more (whole floats
    and NumPy's numbers too; bools refused), or ``None`` if it is not
    one."""
    values = as_items(values)
    if values and all(
            is_real(v) and v >= 1 and float(v).is_integer() for v in values):
        return tuple(int(v) for v in values)
    return None


class ChoiceLayer(nn.Module):
    """One searchable layer: candidate blocks of which one is active.

    The active block is an attribute, not a forward argument, so the layer
    can be wrapped or hooked like any ``module(x)``.

    Args:
        in_channels (int): Input channels.
        out_channels (int): Output channels.
        stride (int): 1 or 2.
        choices (Sequence[str]): Names from :data:`SPOS_CHOICES`.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int,
                 choices: Sequence[str]):
        super().__init__()
        self.choices = nn.ModuleDict({
            name:
            ShuffleUnit(in_channels, out_channels, stride,
                        **SPOS_CHOICES[name])
            for name in choices
        })
        self.active_choice = choices[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the active candidate block."""
        return self.choices[self.active_choice](x)


@MODELS.register_module()
class SPOSSupernet(BaseImageClassifier):
    """A SPOS supernet (ShuffleNetV2 search space) that samples its path.

    Every training forward in ``mode='loss'`` draws a new path, one choice
    per layer uniformly at random, from a private ``random.Random(seed)``:
    two models with the same seed take the same sequence of paths, and
    torch's global RNG is never touched. Every other forward (``'tensor'``,
    ``'predict'``, or ``'loss'`` in eval mode) reuses the last path, or, if
    nothing was sampled yet, the first choice in every layer.
    :meth:`set_path` fixes a path instead.

    The path used by the latest forward is ``model.last_path``, a tuple of
    choice names. Unused choices get no gradient, so DDP needs
    ``find_unused_parameters=True``; all ranks take the same paths when
    they share the seed. The sampler state is not saved in checkpoints.

    Args:
        num_classes (int): Number of classes. Defaults to 1000.
        widen_factor (float): Channel multiplier of the stages (rounded to
            multiples of 8). Defaults to 1.0.
        stage_blocks (Sequence[int]): Layers per stage.
            Defaults to (4, 4, 8, 4).
        stage_channels (Sequence[int]): Output channels per stage at
            ``widen_factor=1``. Defaults to (64, 160, 320, 640).
        stem_channels (int): Channels of the stride-2 3x3 stem.
            Defaults to 16.
        last_channels (int): Channels of the last 1x1 conv.
            Defaults to 1024.
        choices (Sequence[str]): Candidate blocks of every layer, names from
            ``'shuffle_3x3'``, ``'shuffle_5x5'``, ``'shuffle_7x7'``,
            ``'shuffle_xception'``. Defaults to all four.
        seed (int): Seed of the path sampler. Defaults to 0.
        dropout (float): Dropout before the linear head. Defaults to 0.
        in_channels (int): Image channels. Defaults to 3.
        data_preprocessor (dict | nn.Module, optional): Defaults to
            :class:`TensorBatchPreprocessor`.
        init_cfg (dict, optional): MMEngine initialisation config.

    Examples:
        >>> model = dict(type='SPOSSupernet', num_classes=1000, seed=0)
        >>> # a smaller search space:
        >>> model = dict(
        ...     type='SPOSSupernet', choices=['shuffle_3x3', 'shuffle_7x7'])
    """

    def __init__(self,
                 num_classes: int = 1000,
                 widen_factor: float = 1.0,
                 stage_blocks: Sequence[int] = (4, 4, 8, 4),
                 stage_channels: Sequence[int] = (64, 160, 320, 640),
                 stem_channels: int = 16,
                 last_channels: int = 1024,
                 choices: Sequence[str] = tuple(SPOS_CHOICES),
                 seed: int = 0,
                 dropout: float = 0.0,
                 in_channels: int = 3,
                 data_preprocessor: Optional[Union[dict, nn.Module]] = None,
                 init_cfg: Optional[dict] = None):
        super().__init__(num_classes, data_preprocessor, init_cfg)
        dropout = check_probability(type(self).__name__, 'dropout', dropout)
        given = choices
        choices = as_items(choices)  # a string is not its characters
        unknown = [
            name for name in choices
            if not isinstance(name, str) or name not in SPOS_CHOICES
        ]
        if not choices or unknown or len(set(choices)) != len(choices):
            raise MmdtrError(
                f'SPOSSupernet choices must be a list of distinct names from '
                f'{list(SPOS_CHOICES)}, got {given!r}.',
                hint='give at least one of those names, each once, e.g. '
                "choices=['shuffle_3x3', 'shuffle_7x7'].")
        if not is_real(widen_factor) or not 0 < widen_factor < float('inf'):
            raise MmdtrError(
                'SPOSSupernet widen_factor must be a positive number, got '
                f'{widen_factor!r}.',
                hint='set model.widen_factor to e.g. 1.0 (channels are '
                'rounded to multiples of 8).')
        in_channels, stem_channels, last_channels = check_positive_ints(
            'SPOSSupernet',
            in_channels=in_channels,
            stem_channels=stem_channels,
            last_channels=last_channels)
        blocks, channels = (_positive_ints(stage_blocks),
                            _positive_ints(stage_channels))
        if blocks is None or channels is None or len(blocks) != len(channels):
            raise MmdtrError(
                'SPOSSupernet stage_blocks and stage_channels must be lists '
                'of positive ints of the same length, got '
                f'{stage_blocks!r} and {stage_channels!r}.',
                hint='give one block count of 1 or more and one channel '
                'count per stage, e.g. stage_blocks=(4, 4, 8, 4) with '
                'stage_channels=(64, 160, 320, 640).')
        if not is_integer(seed) or seed < 0:
            raise MmdtrError(
                f'SPOSSupernet seed must be a non-negative int, got {seed!r}.',
                hint='set model.seed to an int of 0 or more, e.g. seed=0.')
        self.choices = choices
        self.seed = seed = int(seed)
        widen_factor, stage_blocks, stage_channels = (float(widen_factor),
                                                      blocks, channels)

        stem = [nn.Conv2d(in_channels, stem_channels, 3, 2, 1, bias=False)]
        stem += [nn.BatchNorm2d(stem_channels), nn.ReLU(inplace=True)]
        layers = []
        channels = stem_channels
        for num_blocks, base in zip(stage_blocks, stage_channels):
            out_channels = _make_divisible(base * widen_factor)
            for i in range(num_blocks):
                stride = 2 if i == 0 else 1
                layers.append(
                    ChoiceLayer(channels, out_channels, stride, choices))
                channels = out_channels
        self.backbone = nn.Sequential()
        self.backbone.add_module('stem', nn.Sequential(*stem))
        self.backbone.add_module('layers', nn.Sequential(*layers))
        self.backbone.add_module(
            'conv_last', nn.Sequential(*conv_bn(channels, last_channels, 1)))
        self.head = LinearClsHead(last_channels, num_classes, dropout)
        init_conv_bn_linear(self)

        self.fixed_path: Optional[Tuple[str, ...]] = None
        self.last_path: Optional[Tuple[str, ...]] = None
        self.num_sampled_paths = 0
        self._path_rng = random.Random(seed)

    @property
    def choice_layers(self) -> Tuple[ChoiceLayer, ...]:
        """The searchable layers, in forward order."""
        return tuple(self.backbone.layers)

    def sample_path(self) -> Tuple[str, ...]:
        """Draw the next path from the private sampler.

        Returns:
            tuple[str]: One choice name per layer.
        """
        self.num_sampled_paths += 1
        return tuple(
            self._path_rng.choice(self.choices) for _ in self.choice_layers)

    def reset_sampler(self, seed: Optional[int] = None) -> None:
        """Restart the path sequence, from ``seed`` or the model's seed.

        Args:
            seed (int, optional): A new seed. Defaults to ``self.seed``.
        """
        self.seed = self.seed if seed is None else seed
        self._path_rng = random.Random(self.seed)
        self.num_sampled_paths = 0

    def set_path(self, path: Optional[Sequence[str]]) -> None:
        """Fix the path of every forward, or go back to sampling with None.

        Args:
            path (Sequence[str] | None): One choice name per layer.
        """
        if path is not None:
            path = tuple(path)
            self._check_path(path)
        self.fixed_path = path

    def _check_path(self, path: Tuple[str, ...]) -> None:
        num_layers = len(self.choice_layers)
        if len(path) != num_layers or any(c not in self.choices for c in path):
            raise MmdtrError(
                f'an SPOS path needs {num_layers} names from '
                f'{list(self.choices)}, got {list(path)}.',
                hint='give one choice name per layer of '
                'model.choice_layers, e.g. model.sample_path(); or None to '
                'go back to sampling.')

    def _activate(self, path: Tuple[str, ...]) -> None:
        for layer, choice in zip(self.choice_layers, path):
            layer.active_choice = choice
        self.last_path = path

    def forward(self,
                inputs: torch.Tensor,
                data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor'):
        """Pick the path (see the class doc), then run the classifier.

        Args:
            inputs (Tensor): Images of shape (N, C, H, W).
            data_samples (Tensor, optional): Class indices of shape (N,).
            mode (str): ``'tensor'``, ``'loss'`` or ``'predict'``, as in
                :meth:`BaseImageClassifier.forward`.

        Returns:
            Tensor | dict | list[dict]: See
            :meth:`BaseImageClassifier.forward`.
        """
        if self.fixed_path is not None:
            path = self.fixed_path
        elif mode == 'loss' and self.training:
            path = self.sample_path()
        elif self.last_path is not None:
            path = self.last_path
        else:
            path = (self.choices[0], ) * len(self.choice_layers)
        self._activate(path)
        return super().forward(inputs, data_samples, mode)
