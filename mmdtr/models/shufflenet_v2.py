"""ShuffleNetV2: channel split, depthwise convs and channel shuffle."""
from typing import Optional, Union

import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODELS
from .arguments import check_positive_int, check_probability, is_real
from .base_classifier import (BaseImageClassifier, LinearClsHead,
                              init_conv_bn_linear)


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave the channels of ``groups`` groups (view, transpose, view).

    Args:
        x (Tensor): A feature map of shape (N, C, H, W); C divisible by
            ``groups``.
        groups (int): Number of channel groups.

    Returns:
        Tensor: The shuffled feature map, same shape.
    """
    n, c, h, w = x.size()
    x = x.view(n, groups, c // groups, h, w)
    return x.transpose(1, 2).contiguous().view(n, c, h, w)


def conv_bn(in_channels: int,
            out_channels: int,
            kernel_size: int,
            stride: int = 1,
            depthwise: bool = False,
            relu: bool = True) -> list:
    """Layers of a conv (no bias, same padding), a BN and an optional ReLU.

    Args:
        in_channels (int): Input channels.
        out_channels (int): Output channels; must equal ``in_channels``
            when ``depthwise``.
        kernel_size (int): Odd kernel size.
        stride (int): Stride. Defaults to 1.
        depthwise (bool): One group per channel. Defaults to False.
        relu (bool): Append an in-place ReLU. Defaults to True.

    Returns:
        list[nn.Module]: The layers, to put in an ``nn.Sequential``.
    """
    layers = [
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=kernel_size // 2,
            groups=in_channels if depthwise else 1,
            bias=False),
        nn.BatchNorm2d(out_channels)
    ]
    if relu:
        layers.append(nn.ReLU(inplace=True))
    return layers


class ShuffleUnit(nn.Module):
    """The ShuffleNetV2 unit, with a kernel size and an Xception variant.

    With stride 1 the input is split in two halves: one passes through, the
    other goes through the main branch. With stride 2 the whole input goes
    through both a depthwise projection branch and the main branch. The two
    halves are concatenated and channel-shuffled.

    Args:
        in_channels (int): Input channels; equal to ``out_channels`` when
            ``stride`` is 1.
        out_channels (int): Output channels; must be even.
        stride (int): 1 or 2. Defaults to 1.
        kernel_size (int): Depthwise kernel size (3, 5, 7). Defaults to 3.
        xception (bool): Use the Xception-like main branch of SPOS (three
            depthwise 3x3 + pointwise pairs); ``kernel_size`` is then
            ignored. Defaults to False.
    """

    def __init__(self,
                 in_channels: int,
                 out_channels: int,
                 stride: int = 1,
                 kernel_size: int = 3,
                 xception: bool = False):
        super().__init__()
        if stride not in (1, 2) or out_channels % 2:
            raise MmdtrError(
                f'ShuffleUnit needs stride 1 or 2 and even out_channels, '
                f'got stride={stride}, out_channels={out_channels}.',
                hint='give stride 1 or 2 and an even out_channels (the '
                'output is two halves of out_channels // 2).')
        if stride == 1 and in_channels != out_channels:
            raise MmdtrError(
                f'ShuffleUnit with stride 1 keeps the channels, got '
                f'{in_channels} -> {out_channels}.',
                hint='give in_channels == out_channels, or stride 2 to '
                'change the channels.')
        self.stride = stride
        branch_channels = out_channels // 2
        if stride > 1:
            proj = conv_bn(
                in_channels,
                in_channels,
                kernel_size,
                stride,
                depthwise=True,
                relu=False)
            proj += conv_bn(in_channels, branch_channels, 1)
            self.branch_proj = nn.Sequential(*proj)
        main_in = in_channels if stride > 1 else branch_channels
        if xception:
            # (depthwise 3x3, pointwise) x 3; only the first one strides
            layers = conv_bn(
                main_in, main_in, 3, stride, depthwise=True, relu=False)
            layers += conv_bn(main_in, branch_channels, 1)
            for _ in range(2):
                layers += conv_bn(
                    branch_channels,
                    branch_channels,
                    3,
                    depthwise=True,
                    relu=False)
                layers += conv_bn(branch_channels, branch_channels, 1)
        else:
            layers = conv_bn(main_in, branch_channels, 1)
            layers += conv_bn(
                branch_channels,
                branch_channels,
                kernel_size,
                stride,
                depthwise=True,
                relu=False)
            layers += conv_bn(branch_channels, branch_channels, 1)
        self.branch_main = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split (or project), run the main branch, concat and shuffle."""
        if self.stride == 1:
            x_pass, x_main = x.chunk(2, dim=1)
            out = torch.cat((x_pass, self.branch_main(x_main)), dim=1)
        else:
            out = torch.cat((self.branch_proj(x), self.branch_main(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """ShuffleNetV2 backbone; returns the feature map after ``conv_last``.

    Args:
        widen_factor (float): One of 0.5, 1.0, 1.5, 2.0. Defaults to 1.0.
        in_channels (int): Image channels. Defaults to 3.
    """
    # widen factor -> channels of stages 1-3 and of the last conv
    arch_settings = {
        0.5: (48, 96, 192, 1024),
        1.0: (116, 232, 464, 1024),
        1.5: (176, 352, 704, 1024),
        2.0: (244, 488, 976, 2048),
    }
    stage_blocks = (4, 8, 4)

    def __init__(self, widen_factor: float = 1.0, in_channels: int = 3):
        super().__init__()
        if not is_real(widen_factor) or widen_factor not in self.arch_settings:
            raise MmdtrError(
                f'ShuffleNetV2 widen_factor must be one of '
                f'{sorted(self.arch_settings)}, got {widen_factor!r}.',
                hint='set model.widen_factor to one of those, e.g. 1.0.')
        widen_factor = float(widen_factor)
        in_channels = check_positive_int('ShuffleNetV2', 'in_channels',
                                         in_channels)
        *stage_channels, last_channels = self.arch_settings[widen_factor]
        stem_channels = 24
        self.stem = nn.Sequential(*conv_bn(in_channels, stem_channels, 3, 2))
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.stages = nn.ModuleList()
        channels = stem_channels
        for out_channels, num_blocks in zip(stage_channels, self.stage_blocks):
            units = [ShuffleUnit(channels, out_channels, stride=2)]
            units += [
                ShuffleUnit(out_channels, out_channels)
                for _ in range(num_blocks - 1)
            ]
            self.stages.append(nn.Sequential(*units))
            channels = out_channels
        self.conv_last = nn.Sequential(*conv_bn(channels, last_channels, 1))
        self.out_channels = last_channels
        init_conv_bn_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the last feature map, (N, out_channels, H/32, W/32)."""
        x = self.maxpool(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        return self.conv_last(x)


@MODELS.register_module()
class ShuffleNetV2Classifier(BaseImageClassifier):
    """A ShuffleNetV2 image classifier.

    Args:
        widen_factor (float): One of 0.5, 1.0, 1.5, 2.0. Defaults to 1.0.
        num_classes (int): Number of classes. Defaults to 1000.
        in_channels (int): Image channels. Defaults to 3.
        dropout (float): Dropout before the linear head. Defaults to 0.
        data_preprocessor (dict | nn.Module, optional): Defaults to
            :class:`TensorBatchPreprocessor`.
        init_cfg (dict, optional): MMEngine initialisation config.

    Examples:
        >>> model = dict(
        ...     type='ShuffleNetV2Classifier', widen_factor=1.0,
        ...     num_classes=1000)
    """

    def __init__(self,
                 widen_factor: float = 1.0,
                 num_classes: int = 1000,
                 in_channels: int = 3,
                 dropout: float = 0.0,
                 data_preprocessor: Optional[Union[dict, nn.Module]] = None,
                 init_cfg: Optional[dict] = None):
        super().__init__(num_classes, data_preprocessor, init_cfg)
        dropout = check_probability(type(self).__name__, 'dropout', dropout)
        self.backbone = ShuffleNetV2(widen_factor, in_channels)
        self.head = LinearClsHead(self.backbone.out_channels, num_classes,
                                  dropout)
        init_conv_bn_linear(self.head)
