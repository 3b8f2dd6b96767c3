"""DTR for one training step, and the DDP wrapper that runs it per rank.

:class:`DTRTrainStep` runs a model's ``train_step`` with a fresh
:class:`~mmdtr.dtr.DTR` engine per iteration: the engine is entered before
the data preprocessor and the forward, and closed as soon as
``optim_wrapper.backward`` returns, so gradient clipping, the optimizer step
and ``zero_grad`` run without it (and an iteration that only accumulates
gradients closes it too). With several optimizers (an ``OptimWrapperDict``)
it spans the whole ``train_step``. An exception anywhere in the iteration
closes it as well: no dispatch mode or saved-tensor hooks stay on the
thread. The engine's statistics of each iteration go to MMEngine's
``MessageHub``.

:class:`DTRDistributedDataParallel` is the DDP wrapper whose ``train_step``
runs a :class:`DTRTrainStep`: one engine per rank, around DDP's forward and
the backward in which DDP all-reduces the gradients.
:class:`~mmdtr.adapters.dtr_hook.DTRHook` (the ``dtr`` config key) either
hands its settings to this wrapper or, for any other model, runs the same
:class:`DTRTrainStep` itself; see docs/dtr_training.md.
"""
import difflib
from typing import Callable, Optional

import torch
from mmengine.logging import MessageHub
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import nn

from mmdtr.dtr import DTR, DTRStats, engine_active
from mmdtr.errors import MmdtrError
from mmdtr.registry import MODEL_WRAPPERS
from .distributed import MMDTRDistributedDataParallel

#: The sub-keys of ``dtr`` (the arguments of :class:`~mmdtr.dtr.DTR` that a
#: config sets; the device is the model's).
DTR_SUB_KEYS = ('eviction_threshold', 'evictee_minimum_size',
                'enable_sqrt_sampling', 'policy')
_EXAMPLE = ("dtr=dict(eviction_threshold='2GB', evictee_minimum_size='1MB', "
            "enable_sqrt_sampling=False, policy='dtr')")
#: MessageHub scalar name -> how to get it from the engine's stats
SCALARS = {
    'train/dtr_peak_memory_mb': lambda s: s.peak_memory / 2**20,
    'train/dtr_evictions': lambda s: s.evictions,
    'train/dtr_recomputations': lambda s: s.recomputations,
    'train/dtr_remat_seconds': lambda s: s.remat_seconds,
    'train/dtr_eviction_failures': lambda s: s.eviction_failures,
}


def dtr_settings(value, key: str = 'dtr', device=None) -> dict:
    """Validate DTR settings from a config with the engine's own checks.

    A :class:`~mmdtr.dtr.DTR` engine is built (not entered) from the
    settings, so everything the engine rejects is rejected here, before
    training starts.

    Args:
        value (dict): Sub-keys of :data:`DTR_SUB_KEYS`; ``eviction_threshold``
            is required unless ``device`` is CUDA.
        key (str): The config key, for error messages. Defaults to ``'dtr'``.
        device (str | torch.device, optional): The device whose memory is
            metered. Defaults to the engine's default (CUDA if available,
            else CPU).

    Returns:
        dict: The settings as given, as a plain dict.

    Raises:
        MmdtrError: If ``value`` is not a dict, has unknown sub-keys, or has
            a value the engine rejects (a bad size, a non-bool
            ``enable_sqrt_sampling``, an unknown policy, no threshold on
            CPU).

    Examples:
        >>> dtr_settings(dict(eviction_threshold='3GB'))
        {'eviction_threshold': '3GB'}
    """
    if not isinstance(value, dict):
        raise MmdtrError(
            f'{key}={value!r} ({type(value).__name__}) is not accepted; '
            f'expected a dict with the keys {list(DTR_SUB_KEYS)}.',
            hint=f'e.g. {_EXAMPLE}; leave {key} out (or None) for no DTR.')
    for name in value:
        if name not in DTR_SUB_KEYS:
            close = difflib.get_close_matches(str(name), DTR_SUB_KEYS, n=2)
            raise MmdtrError(
                f'{key}.{name} is not a DTR setting; accepted: '
                f'{list(DTR_SUB_KEYS)}' +
                (f', closest matches: {close}.' if close else '.'),
                hint=f'e.g. {_EXAMPLE}.')
    settings = dict(value)
    try:
        DTR(device=device, **settings)
    except MmdtrError as e:
        raise MmdtrError(
            f'{key}={settings!r} is not accepted: {e.message}',
            hint=e.hint) from None
    return settings


def model_device(model: nn.Module) -> Optional[torch.device]:
    """The device of the first parameter of ``model``, or None."""
    for param in model.parameters():
        return param.device
    return None


class DTRTrainStep:
    """Run ``train_step`` with its forward and backward under DTR.

    Each call builds a fresh engine, enters it, runs ``train_step`` and
    closes the engine when ``optim_wrapper.backward`` returns (before
    gradient clipping and the optimizer step), or when ``train_step`` ends
    or raises, whichever comes first. With an ``OptimWrapperDict`` (several
    optimizers, each with its own backward, as GANs train) the engine spans
    the whole ``train_step``, optimizer steps included. The statistics of
    the iteration are :attr:`stats` and go to the ``MessageHub`` as the
    scalars in :data:`SCALARS` (``train/dtr_peak_memory_mb``,
    ``train/dtr_evictions``, ``train/dtr_recomputations``,
    ``train/dtr_remat_seconds``, ``train/dtr_eviction_failures``).

    Args:
        settings (dict): See :func:`dtr_settings`.
        device (str | torch.device, optional): The metered device; the
            model's. Defaults to the engine's default.
        message_hub (MessageHub, optional): Where the statistics go.
            Defaults to ``MessageHub.get_current_instance()`` at each call.

    Examples:
        >>> step = DTRTrainStep(dict(eviction_threshold='2GB'))
        >>> log_vars = step(model.train_step, data_batch, optim_wrapper)
        >>> step.stats.evictions
    """

    def __init__(self,
                 settings: dict,
                 device=None,
                 message_hub: Optional[MessageHub] = None):
        self.settings = dtr_settings(settings, device=device)
        self.device = device
        self.message_hub = message_hub
        #: DTRStats of the latest iteration that ended without an error
        self.stats: Optional[DTRStats] = None
        #: False once detached (DTRHook.after_train): a reference left
        #: behind (a hook that saved the wrapped train_step and put it back)
        #: then runs train_step as it is, with no engine and no statistics
        self.enabled = True

    def __call__(self, train_step: Callable, data, optim_wrapper):
        """Run ``train_step(data, optim_wrapper)`` under a fresh engine."""
        if not self.enabled:
            return train_step(data, optim_wrapper)
        if not isinstance(optim_wrapper, OptimWrapper):
            raise MmdtrError(
                f'DTR runs train_step(data, optim_wrapper) with an '
                f'OptimWrapper or an OptimWrapperDict, got '
                f'{type(optim_wrapper).__name__}.',
                hint='OptimWrapper and its subclasses (AmpOptimWrapper, '
                'OptimWrapperDict, ...) are supported; other '
                'BaseOptimWrapper types are not.')
        if engine_active():
            raise MmdtrError(
                'a DTR engine is already active on this thread; DTR runs '
                'one engine per process (rank), never two nested.',
                hint='configure DTR once: the dtr key, a DTRHook or '
                'model_wrapper_cfg.dtr, and no mmdtr.dtr.enable().')
        engine = DTR(device=self.device, **self.settings)
        if isinstance(optim_wrapper, OptimWrapperDict):
            # several backwards (GANs): the engine spans the whole step,
            # optimizer steps included (R7 orders their parameter writes)
            with engine:
                result = train_step(data, optim_wrapper)
        else:
            result = self._close_after_backward(engine, train_step, data,
                                                optim_wrapper)
        self.stats = engine.stats
        self._publish(self.stats)
        return result

    @staticmethod
    def _close_after_backward(engine, train_step, data, optim_wrapper):
        had_own = 'backward' in vars(optim_wrapper)
        backward = optim_wrapper.backward

        def close():
            if engine.active:
                engine.__exit__(None, None, None)

        def backward_then_close(loss, **kwargs):
            try:
                return backward(loss, **kwargs)
            finally:
                close()  # before gradient clipping and the step

        optim_wrapper.backward = backward_then_close
        try:
            engine.__enter__()
            return train_step(data, optim_wrapper)
        finally:
            try:
                close()
            finally:
                if had_own:
                    optim_wrapper.backward = backward
                else:
                    del optim_wrapper.backward

    def _publish(self, stats: DTRStats) -> None:
        hub = self.message_hub or MessageHub.get_current_instance()
        for name, get in SCALARS.items():
            # not resumed: an iteration's figures are no training state,
            # and a run resumed without DTR would log the checkpoint's
            hub.update_scalar(name, get(stats), resumed=False)


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
        dtr (dict, optional): DTR settings, see :func:`dtr_settings`.
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
            settings (dict): See :func:`dtr_settings`.
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
        device = model_device(self.module)
        dtr_settings(settings, key, device)
        self.dtr_step = DTRTrainStep(settings, device, message_hub)
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


__all__ = [
    'DTR_SUB_KEYS', 'SCALARS', 'DTRTrainStep', 'DTRDistributedDataParallel',
    'dtr_settings', 'model_device'
]
