"""What the image classifiers share: head, weight init, the three modes."""
from typing import Dict, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModel

from mmdtr.errors import MmdtrError
from .arguments import is_integer
from .data_preprocessor import build_data_preprocessor

MODES = ('tensor', 'loss', 'predict')


class LinearClsHead(nn.Module):
    """Global average pooling, optional dropout and a linear classifier.

    Args:
        in_channels (int): Channels of the backbone's last feature map.
        num_classes (int): Number of classes.
        dropout (float): Dropout probability before the linear layer.
            Defaults to 0.
    """

    def __init__(self,
                 in_channels: int,
                 num_classes: int,
                 dropout: float = 0.0):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (N, num_classes) from (N, C, H, W)."""
        return self.fc(self.dropout(torch.flatten(self.pool(feats), 1)))


def init_conv_bn_linear(module: nn.Module) -> None:
    """Kaiming-init convolutions; BN to identity; small normal linears.

    Args:
        module (nn.Module): The module whose submodules are initialised.
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(
                m.weight, mode='fan_out', nonlinearity='relu')
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.zeros_(m.bias)


class BaseImageClassifier(BaseModel):
    """An image classifier: ``backbone`` then ``head``, cross-entropy loss.

    Subclasses set ``self.backbone`` (images to a feature map) and
    ``self.head`` (feature map to logits).

    Args:
        num_classes (int): Number of classes; must be positive.
        data_preprocessor (dict | nn.Module, optional): The data
            preprocessor. Defaults to :class:`TensorBatchPreprocessor`.
        init_cfg (dict, optional): MMEngine initialisation config.
    """

    def __init__(self,
                 num_classes: int,
                 data_preprocessor: Optional[Union[dict, nn.Module]] = None,
                 init_cfg: Optional[dict] = None):
        if not is_integer(num_classes) or num_classes < 1:
            raise MmdtrError(
                f'model.num_classes must be a positive int, got '
                f'{num_classes!r}.',
                hint='set model.num_classes to the number of classes of the '
                'dataset, e.g. num_classes=1000.')
        super().__init__(
            data_preprocessor=build_data_preprocessor(data_preprocessor),
            init_cfg=init_cfg)
        self.num_classes = int(num_classes)

    def forward(
        self,
        inputs: torch.Tensor,
        data_samples: Optional[torch.Tensor] = None,
        mode: str = 'tensor'
    ) -> Union[torch.Tensor, Dict[str, torch.Tensor], List[dict]]:
        """Run the classifier in one of MMEngine's three modes.

        Args:
            inputs (Tensor): Images of shape (N, C, H, W).
            data_samples (Tensor, optional): Class indices of shape (N,);
                required for ``mode='loss'``.
            mode (str): ``'tensor'`` returns the logits (N, num_classes);
                ``'loss'`` returns ``dict(loss=...)``, the mean
                cross-entropy; ``'predict'`` returns one dict per image with
                ``pred_label``, ``pred_score`` (softmax) and, when labels are
                given, ``gt_label``.

        Returns:
            Tensor | dict | list[dict]: See ``mode``.
        """
        if mode not in MODES:
            raise MmdtrError(
                f'forward mode must be one of {MODES}, got {mode!r}.',
                hint="call the model with mode='tensor', 'loss' or "
                "'predict'.")
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
            raise MmdtrError(
                'image inputs must be a tensor of shape (N, C, H, W), got '
                f'{describe_value(inputs)}.',
                hint='the dataset must return each image as inputs, a '
                'tensor of shape (C, H, W).')
        labels = self._check_labels(data_samples, inputs.size(0))
        logits = self.head(self.backbone(inputs))
        if mode == 'tensor':
            return logits
        if mode == 'loss':
            if labels is None:
                raise MmdtrError(
                    "mode='loss' needs the class labels as data_samples.",
                    hint='the dataset must return dict(inputs=..., '
                    'data_samples=label).')
            return dict(loss=F.cross_entropy(logits, labels))
        scores = F.softmax(logits.detach(), dim=1)
        pred_labels = scores.argmax(dim=1)
        predictions = []
        for i in range(scores.size(0)):
            pred = dict(pred_label=pred_labels[i], pred_score=scores[i])
            if labels is not None:
                pred['gt_label'] = labels[i]
            predictions.append(pred)
        return predictions

    @staticmethod
    def _check_labels(data_samples, batch_size: int):
        if data_samples is None:
            return None
        if (not isinstance(data_samples, torch.Tensor)
                or data_samples.shape != (batch_size, )
                or data_samples.dtype not in (torch.int64, torch.int32)):
            raise MmdtrError(
                'classifier data_samples must be an int64 tensor of class '
                f'indices with shape ({batch_size},), got '
                f'{describe_value(data_samples)}.',
                hint='the dataset must return each class index as '
                'data_samples, an int64 scalar tensor.')
        return data_samples.long()


def describe_value(value) -> str:
    """Say what ``value`` is, with dtype and shape for a tensor."""
    if isinstance(value, torch.Tensor):
        return f'a {value.dtype} tensor of shape {tuple(value.shape)}'
    return f'a {type(value).__name__}'
