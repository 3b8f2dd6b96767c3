"""Distributed data-parallel wrappers that run on CPU (gloo).

MMEngine 0.10.7's ``Runner.wrap_model`` passes ``device_ids=[LOCAL_RANK]``
to DDP, which fails for a module on the CPU. mmdtr's runner
(:mod:`mmdtr.adapters.runner`) uses the two wrappers below instead when no
accelerator is available; with CUDA, MMEngine's own
``MMDistributedDataParallel`` is kept. The CPU process group they need is
set up by :mod:`mmdtr.adapters.cpu_process_group`.
"""
from mmengine.model import (MMDistributedDataParallel,
                            MMSeparateDistributedDataParallel)
from torch import nn

from mmdtr.registry import MODEL_WRAPPERS


def _on_cpu(module: nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return all(t.device.type == 'cpu' for t in tensors)


def _without_cuda_devices(module: nn.Module, kwargs: dict) -> dict:
    """DDP's keyword arguments for ``module``: on the CPU, without the
    CUDA ``device_ids`` and ``output_device`` MMEngine's runner passes."""
    if _on_cpu(module):
        kwargs.pop('device_ids', None)
        kwargs.pop('output_device', None)
    return kwargs


@MODEL_WRAPPERS.register_module()
class MMDTRDistributedDataParallel(MMDistributedDataParallel):
    """:class:`~mmengine.model.MMDistributedDataParallel` that runs on CPU.

    MMEngine's runner always passes ``device_ids=[LOCAL_RANK]``, which DDP
    rejects for a CPU module. This wrapper drops ``device_ids`` and
    ``output_device`` when the module lives on the CPU and is otherwise
    identical to ``MMDistributedDataParallel``. mmdtr's runner uses it by
    default for distributed training on CPU; subclass it to add per-rank
    behaviour.

    Args:
        module (nn.Module): The model to wrap.
        detect_anomalous_params (bool): See ``MMDistributedDataParallel``.
            Defaults to False.
        **kwargs: Passed to :class:`torch.nn.parallel.DistributedDataParallel`.

    Examples:
        >>> # only needed to pass DDP options; on CPU the default is this
        >>> # type, with find_unused_parameters from the config (False)
        >>> model_wrapper_cfg = dict(
        ...     type='mmdtr.MMDTRDistributedDataParallel',
        ...     broadcast_buffers=False,
        ...     find_unused_parameters=True)
    """

    def __init__(self,
                 module: nn.Module,
                 detect_anomalous_params: bool = False,
                 **kwargs):
        super().__init__(
            module=module,
            detect_anomalous_params=detect_anomalous_params,
            **_without_cuda_devices(module, kwargs))


@MODEL_WRAPPERS.register_module()
class MMDTRSeparateDistributedDataParallel(MMSeparateDistributedDataParallel):
    """:class:`~mmengine.model.MMSeparateDistributedDataParallel` that runs
    on CPU: each sub-module's DDP gets no ``device_ids`` there (MMEngine's
    runner passes CUDA ones). For models with one optimizer per sub-module
    (GANs); :class:`MMDTRRunner` uses it on CPU in place of MMEngine's.

    Args:
        module (nn.Module): The model to wrap.
        broadcast_buffers (bool): See DDP. Defaults to False.
        find_unused_parameters (bool): See DDP. Defaults to False.
        **kwargs: Passed to each sub-module's DDP.

    Examples:
        >>> model_wrapper_cfg = dict(
        ...     type='mmdtr.MMDTRSeparateDistributedDataParallel')
    """

    def __init__(self,
                 module: nn.Module,
                 broadcast_buffers: bool = False,
                 find_unused_parameters: bool = False,
                 **kwargs):
        super().__init__(
            module,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            **_without_cuda_devices(module, kwargs))
