"""The DDP wrapper that runs a DTR training step on every rank.

:class:`DTRDistributedDataParallel` is the DDP wrapper whose ``train_step``
runs a :class:`~mmdtr.adapters.dtr_train_step.DTRTrainStep`: one engine per
rank, around DDP's forward and the backward in which DDP all-reduces the
gradients. :class:`~mmdtr.adapters.dtr_hook.DTRHook` (the ``dtr`` config
key) either hands its settings to this wrapper or, for any other model, runs
the same :class:`~mmdtr.adapters.dtr_train_step.DTRTrainStep` itself; see
docs/dtr_training.md.
"""
from typing import Optional

from mmengine.logging import MessageHub
from torch import nn

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODEL_WRAPPERS
from .distributed import MMDTRDistributedDataParallel
from .dtr_train_step import DTRTrainStep, model_device


@MODEL_WRAPPERS.register_module()
class DTRDistributedDataParallel(MMDTRDistributedDataParallel):
    """DDP (gloo on CPU, nccl on CUDA) with a DTR engine on every rank.

    ``train_step`` runs DDP's own ``train_step`` through a
    :class:`DTRTrainStep`: each rank's engine is entered before DDP's
    forward and closed after the backward in which DDP all-reduces the
    gradients, before the optimizer step. DDP's reducer hooks fire on
    gradient accumulation, not on saved tensors, so they see the gradients
    exactly as without DTR; the all-reduced gradients are bit-identical.
    ``val_step`` and ``test_step`` never run under DTR.

    Without ``dtr`` it is :class:`MMDTRDistributedDataParallel` until
    :meth:`enable_dtr` is called, which is what
    :class:`~mmdtr.adapters.dtr_hook.DTRHook` (the ``dtr`` key) does when it
    finds this wrapper. Configure DTR in one place only: the ``dtr`` key or
    ``model_wrapper_cfg.dtr``.

    Args:
        module (nn.Module): The model to wrap.
        dtr (dict, optional): DTR settings, see
            :func:`~mmdtr.adapters.dtr_train_step.dtr_settings`.
            Defaults to None (no DTR until :meth:`enable_dtr`).
        detect_anomalous_params (bool): See ``MMDistributedDataParallel``.
            Defaults to False.
        **kwargs: Passed to :class:`torch.nn.parallel.DistributedDataParallel`.

    Examples:
        >>> # for a runner that does not translate the dtr key
        >>> model_wrapper_cfg = dict(
        ...     type='mmdtr.DTRDistributedDataParallel',
        ...     dtr=dict(eviction_threshold='2GB'),
        ...     find_unused_parameters=False)
    """

    def __init__(self,
                 module: nn.Module,
                 dtr: Optional[dict] = None,
                 detect_anomalous_params: bool = False,
                 **kwargs):
        super().__init__(
            module=module,
            detect_anomalous_params=detect_anomalous_params,
            **kwargs)
        self.dtr_step: Optional[DTRTrainStep] = None
        if dtr is not None:
            self.enable_dtr(dtr, key='model_wrapper_cfg.dtr')

    def enable_dtr(self,
                   settings: dict,
                   message_hub: Optional[MessageHub] = None,
                   key: str = 'dtr') -> DTRTrainStep:
        """Run every following ``train_step`` under DTR.

        Args:
            settings (dict): See
                :func:`~mmdtr.adapters.dtr_train_step.dtr_settings`.
            message_hub (MessageHub, optional): Where statistics go.
            key (str): The config key, for error messages.

        Returns:
            DTRTrainStep: The step runner, whose ``stats`` are the latest
            iteration's.

        Raises:
            MmdtrError: If DTR is already enabled on this wrapper, or a
                setting is invalid.
        """
        if self.dtr_step is not None:
            raise MmdtrError(
                f'DTR is configured twice for {type(self).__name__}: '
                f'{key}={settings!r} and {self.dtr_step.settings!r}.',
                hint='keep either the dtr key or model_wrapper_cfg.dtr.')
        self.dtr_step = DTRTrainStep(settings, model_device(self.module),
                                     message_hub, key)
        return self.dtr_step

    def disable_dtr(self) -> None:
        """Run the following ``train_step`` calls without DTR."""
        self.dtr_step = None

    def train_step(self, data, optim_wrapper):
        """DDP's ``train_step``, under this rank's engine when enabled.

        Args:
            data (dict | tuple | list): A batch from the dataloader.
            optim_wrapper (OptimWrapper): Updates the parameters.

        Returns:
            dict[str, torch.Tensor]: The log variables of the losses.
        """
        if self.dtr_step is None:
            return super().train_step(data, optim_wrapper)
        return self.dtr_step(super().train_step, data, optim_wrapper)


__all__ = ['DTRDistributedDataParallel']
