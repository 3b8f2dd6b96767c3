"""ResNet (18/34/50/101/152) image classifiers with BN and in-place ReLU."""
from typing import Optional, Union

import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODELS
from .arguments import (check_bool, check_positive_int, check_probability,
                        is_integer)
from .base_classifier import (BaseImageClassifier, LinearClsHead,
                              init_conv_bn_linear)


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """A 3x3 convolution with padding 1 and no bias."""
    return nn.Conv2d(
        in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """A 1x1 convolution with no bias."""
    return nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and an identity shortcut (ResNet-18/34).

    Args:
        in_channels (int): Input channels.
        channels (int): Channels of the convolutions; output channels are
            ``channels * expansion``.
        stride (int): Stride of the first convolution. Defaults to 1.
        downsample (nn.Module, optional): Shortcut projection, needed when
            the shape changes.
    """
    expansion = 1

    def __init__(self,
                 in_channels: int,
                 channels: int,
                 stride: int = 1,
                 downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = conv3x3(in_channels, channels, stride)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(channels, channels)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu_out = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_norm(self) -> nn.BatchNorm2d:
        """The BN before the residual addition."""
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual forward: ``relu(branch(x) + shortcut(x))``."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu_out(out)


class Bottleneck(nn.Module):
    """1x1-3x3-1x1 conv-BN layers and a shortcut (ResNet-50/101/152).

    The stride is on the 3x3 convolution (ResNet v1.5, as torchvision).

    Args:
        in_channels (int): Input channels.
        channels (int): Channels of the inner convolutions; output channels
            are ``channels * expansion``.
        stride (int): Stride of the 3x3 convolution. Defaults to 1.
        downsample (nn.Module, optional): Shortcut projection, needed when
            the shape changes.
    """
    expansion = 4

    def __init__(self,
                 in_channels: int,
                 channels: int,
                 stride: int = 1,
                 downsample: Optional[nn.Module] = None):
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = conv1x1(in_channels, channels)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(channels, channels, stride)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv3 = conv1x1(channels, out_channels)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu_out = nn.ReLU(inplace=True)
        self.downsample = downsample

    def last_norm(self) -> nn.BatchNorm2d:
        """The BN before the residual addition."""
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual forward: ``relu(branch(x) + shortcut(x))``."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu_out(out)


class ResNet(nn.Module):
    """ResNet backbone: stem, four residual stages; returns the last map.

    Module names follow torchvision (``conv1``, ``bn1``, ``layer1`` ...
    ``layer4``, blocks ``layer1.0`` ...), so techniques can address blocks
    by name.

    Args:
        depth (int): One of 18, 34, 50, 101, 152.
        in_channels (int): Image channels. Defaults to 3.
        base_channels (int): Channels of the stem and of the first stage's
            inner convolutions. Defaults to 64.
        zero_init_residual (bool): Zero the last BN of every block, so each
            block starts as the identity. Defaults to False.
    """
    arch_settings = {
        18: (BasicBlock, (2, 2, 2, 2)),
        34: (BasicBlock, (3, 4, 6, 3)),
        50: (Bottleneck, (3, 4, 6, 3)),
        101: (Bottleneck, (3, 4, 23, 3)),
        152: (Bottleneck, (3, 8, 36, 3)),
    }

    def __init__(self,
                 depth: int = 50,
                 in_channels: int = 3,
                 base_channels: int = 64,
                 zero_init_residual: bool = False):
        super().__init__()
        if not is_integer(depth) or depth not in self.arch_settings:
            raise MmdtrError(
                f'ResNet depth must be one of '
                f'{sorted(self.arch_settings)}, got {depth!r}.',
                hint='set model.depth to one of those, e.g. '
                '--cfg-options model.depth=101.')
        depth = int(depth)
        in_channels = check_positive_int('ResNet', 'in_channels', in_channels)
        base_channels = check_positive_int('ResNet', 'base_channels',
                                           base_channels)
        zero_init_residual = check_bool('model.zero_init_residual',
                                        zero_init_residual)
        block, stage_blocks = self.arch_settings[depth]
        self.depth = depth
        self.conv1 = nn.Conv2d(
            in_channels, base_channels, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base_channels)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self._in_channels = base_channels
        for i, num_blocks in enumerate(stage_blocks):
            stage = self._make_stage(
                block, base_channels * 2**i, num_blocks, stride=min(i, 1) + 1)
            self.add_module(f'layer{i + 1}', stage)
        self.out_channels = self._in_channels
        init_conv_bn_linear(self)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_norm().weight)

    def _make_stage(self, block, channels: int, num_blocks: int,
                    stride: int) -> nn.Sequential:
        out_channels = channels * block.expansion
        downsample = None
        if stride != 1 or self._in_channels != out_channels:
            downsample = nn.Sequential(
                conv1x1(self._in_channels, out_channels, stride),
                nn.BatchNorm2d(out_channels))
        blocks = [block(self._in_channels, channels, stride, downsample)]
        self._in_channels = out_channels
        blocks += [block(out_channels, channels) for _ in range(1, num_blocks)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the stage-4 feature map, (N, out_channels, H/32, W/32)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        return self.layer4(x)


@MODELS.register_module()
class ResNetClassifier(BaseImageClassifier):
    """A ResNet image classifier (ResNet-50 by default).

    Args:
        depth (int): One of 18, 34, 50, 101, 152. Defaults to 50.
        num_classes (int): Number of classes. Defaults to 1000.
        in_channels (int): Image channels. Defaults to 3.
        base_channels (int): Width of the stem and first stage.
            Defaults to 64.
        zero_init_residual (bool): Start every block as the identity.
            Defaults to False.
        dropout (float): Dropout before the linear head. Defaults to 0.
        data_preprocessor (dict | nn.Module, optional): Defaults to
            :class:`TensorBatchPreprocessor`.
        init_cfg (dict, optional): MMEngine initialisation config.

    Examples:
        >>> model = dict(type='ResNetClassifier', depth=50, num_classes=1000)
        >>> # ResNet-101 from the command line of a ResNet-50 config:
        >>> # --cfg-options model.depth=101
    """

    def __init__(self,
                 depth: int = 50,
                 num_classes: int = 1000,
                 in_channels: int = 3,
                 base_channels: int = 64,
                 zero_init_residual: bool = False,
                 dropout: float = 0.0,
                 data_preprocessor: Optional[Union[dict, nn.Module]] = None,
                 init_cfg: Optional[dict] = None):
        super().__init__(num_classes, data_preprocessor, init_cfg)
        dropout = check_probability(type(self).__name__, 'dropout', dropout)
        self.backbone = ResNet(depth, in_channels, base_channels,
                               zero_init_residual)
        self.head = LinearClsHead(self.backbone.out_channels, num_classes,
                                  dropout)
        init_conv_bn_linear(self.head)


@MODELS.register_module()
class ResNet50Classifier(ResNetClassifier):
    """ResNet-50 image classifier: :class:`ResNetClassifier` with depth 50.

    Args:
        num_classes (int): Number of classes. Defaults to 1000.
        **kwargs: Other arguments of :class:`ResNetClassifier` except
            ``depth``.

    Examples:
        >>> model = dict(type='ResNet50Classifier', num_classes=1000)
    """

    def __init__(self, num_classes: int = 1000, **kwargs):
        if 'depth' in kwargs:
            raise MmdtrError(
                'ResNet50Classifier has a fixed depth of 50.',
                hint="use type='ResNetClassifier' to choose the depth.")
        super().__init__(depth=50, num_classes=num_classes, **kwargs)
