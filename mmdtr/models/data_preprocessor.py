"""A data preprocessor that stacks a batch and moves it to the model."""
from typing import Sequence

import torch
from mmengine.config import Config
from mmengine.model import BaseDataPreprocessor

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODELS
from .arguments import check_bool


def _stack_if_tensor_list(value):
    """Stack a list or tuple of same-shaped tensors; leave anything else."""
    if (isinstance(value, Sequence) and not isinstance(value, (str, bytes))
            and len(value) > 0
            and all(isinstance(item, torch.Tensor) for item in value)):
        return torch.stack(list(value))
    return value


@MODELS.register_module()
class TensorBatchPreprocessor(BaseDataPreprocessor):
    """Stack ``inputs`` and ``data_samples`` into tensors on the device.

    It accepts the batches of both MMEngine collate functions:
    ``default_collate`` (already stacked tensors, left as they are) and
    ``pseudo_collate`` (lists of per-sample tensors, stacked here on the CPU
    before a single copy to the model's device). No normalisation is done:
    the synthetic datasets already produce model-ready values.

    Args:
        non_blocking (bool): Whether the copy to the device is
            non-blocking. Defaults to False.

    Examples:
        >>> model = dict(
        ...     type='ResNetClassifier',
        ...     data_preprocessor=dict(type='TensorBatchPreprocessor'))
    """

    def __init__(self, non_blocking: bool = False):
        super().__init__(
            non_blocking=check_bool('model.data_preprocessor.non_blocking',
                                    non_blocking))

    def forward(self, data: dict, training: bool = False) -> dict:
        """Stack the batch and copy it to the model's device.

        Args:
            data (dict): A collated batch with an ``inputs`` key and an
                optional ``data_samples`` key.
            training (bool): Unused; there is no training-time
                augmentation. Defaults to False.

        Returns:
            dict: ``dict(inputs=..., data_samples=...)`` on the device.
        """
        batch = dict(
            inputs=_stack_if_tensor_list(data['inputs']),
            data_samples=_stack_if_tensor_list(data.get('data_samples')))
        return self.cast_data(batch)


def build_data_preprocessor(cfg) -> torch.nn.Module:
    """Build a data preprocessor from mmdtr's registry.

    :class:`mmengine.model.BaseModel` builds a config dict from MMEngine's
    root registry, which does not know mmdtr's names unless the default
    scope is ``'mmdtr'``. mmdtr's models therefore build it themselves.

    Args:
        cfg (dict | nn.Module | None): A config dict, a built module, or
            None for :class:`TensorBatchPreprocessor`.

    Returns:
        nn.Module: The data preprocessor.

    Raises:
        MmdtrError: If ``cfg`` is neither None, a module nor a dict with a
            ``type``.
    """
    if cfg is None:
        cfg = dict(type='TensorBatchPreprocessor')
    if isinstance(cfg, torch.nn.Module):
        return cfg
    if not isinstance(cfg, (dict, Config)) or 'type' not in cfg:
        raise MmdtrError(
            f'model.data_preprocessor={cfg!r} is not accepted: None, a '
            'config dict with a type, or a module.',
            hint="e.g. data_preprocessor=dict(type='TensorBatchPreprocessor'"
            '), or leave it out for that default.')
    return MODELS.build(cfg)
