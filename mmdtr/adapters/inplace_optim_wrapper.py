"""MMEngine adapter of in-place parameter updates: an optim wrapper.

The logic lives in :mod:`mmdtr.techniques.inplace_update`.
"""
from contextlib import contextmanager, nullcontext
from typing import Dict, Optional

import torch
import torch.nn as nn
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from torch.optim import Optimizer

from mmdtr.adapters.inplace_optim_settings import (amp_settings,
                                                   check_accumulative_counts,
                                                   check_step_in_backward,
                                                   check_wrapper_keys,
                                                   clip_grad_settings)
from mmdtr.errors import MmdtrError
from mmdtr.registry import OPTIM_WRAPPERS
from mmdtr.techniques.inplace_update import (PerParameterStepper, make_inplace,
                                             release_grads)


def _param_device_type(optimizer: Optimizer) -> str:
    for group in optimizer.param_groups:
        for param in group['params']:
            return param.device.type
    return 'cpu'


@OPTIM_WRAPPERS.register_module()
class InplaceOptimWrapper(OptimWrapper):
    """Update parameters and optimizer state in place; free gradients early.

    Like :class:`mmengine.optim.OptimWrapper` (gradient accumulation,
    clipping, ``optim_context``, ``state_dict``), plus:

    - the optimizer steps one parameter at a time (``foreach=False`` for
      ``torch.optim`` optimizers; ``fused=True`` in the optimizer config is
      kept), so a step allocates no transient copy of the whole parameter
      list; gradients are set to None right after the step;
    - ``step_in_backward=True`` updates each parameter from its
      post-accumulate-grad hook as soon as its gradient is complete and
      frees that gradient, so the gradients of all parameters are never
      alive at once (one whose storage another tensor still views, such
      as a ``weight.detach()`` a later backward node reads, steps at the
      end of the backward). The step and lr-scheduler semantics are
      unchanged: each per-parameter step reads its group's current
      hyper-parameters; a tied
      parameter steps once, after its last gradient contribution; a
      parameter with no gradient does not step. ``optimizer.step()`` still
      runs once per iteration (for its hooks and parameters left with a
      gradient, e.g. from a ``backward`` outside the wrapper);
    - ``amp``: automatic mixed precision with ``torch.autocast`` and
      ``torch.amp.GradScaler`` on the parameters' device (CUDA, or CPU).

    Args:
        optimizer (Optimizer): The optimizer (built from the config).
        accumulative_counts (int): Iterations to accumulate gradients over.
            Must be 1 with ``step_in_backward``. Defaults to 1.
        clip_grad (dict, optional): As for ``OptimWrapper``: ``type``
            ``'norm'`` (default; ``max_norm``, optional ``norm_type``,
            ``error_if_nonfinite``, ``foreach``) or ``'value'``
            (``clip_value``, optional ``foreach``). With
            ``step_in_backward`` only ``dict(type='value', clip_value=v)``
            is accepted (it is per element); norm clipping needs every
            gradient at once. Defaults to None.
        step_in_backward (bool): Step each parameter during the backward.
            Defaults to False.
        amp (dict, optional): ``dict(dtype=..., loss_scale=...)``: ``dtype``
            ``'float16'`` or ``'bfloat16'`` (None: the device's autocast
            default); ``loss_scale`` ``'dynamic'`` (default), a positive
            finite number (static scale), a dict of ``torch.amp.GradScaler``
            arguments, or None (no scaling, e.g. with bfloat16; required
            with ``step_in_backward``, since a scaler must check every
            gradient for inf/NaN before any parameter steps). Defaults to
            None (fp32).
        **unknown: Any other argument is refused (an :class:`MmdtrError`
            naming the closest accepted one).

    Raises:
        MmdtrError: If ``optimizer`` is not an ``Optimizer``, or a setting
            is not accepted (checked by
            :mod:`mmdtr.adapters.inplace_optim_settings`: e.g. a
            ``clip_value`` or ``max_norm`` that is not a positive finite
            number, an infinite ``loss_scale``, an unknown key), if
            ``step_in_backward`` conflicts with another setting or with the
            optimizer (LBFGS), or if the optimizer has ``foreach=True``. All
            settings are checked first: after an error, no hook is left on a
            parameter and the optimizer is unchanged.

    Examples:
        >>> optim_wrapper = dict(
        ...     type='InplaceOptimWrapper',
        ...     optimizer=dict(type='SGD', lr=0.1, momentum=0.9),
        ...     step_in_backward=True)
        >>> optim_wrapper = dict(
        ...     type='mmdtr.InplaceOptimWrapper',
        ...     optimizer=dict(type='AdamW', lr=3e-4, weight_decay=0.1),
        ...     accumulative_counts=4,
        ...     clip_grad=dict(max_norm=1.0),
        ...     amp=dict(dtype='float16', loss_scale='dynamic'))
    """

    def __init__(self,
                 optimizer: Optimizer,
                 accumulative_counts: int = 1,
                 clip_grad: Optional[dict] = None,
                 step_in_backward: bool = False,
                 amp: Optional[dict] = None,
                 **unknown):
        # validate every setting (and build the loss scaler, which touches
        # nothing else) before the optimizer or a parameter is changed
        if not isinstance(optimizer, Optimizer):  # as OptimWrapper's assert
            raise MmdtrError(
                f'InplaceOptimWrapper optimizer must be a '
                f'torch.optim.Optimizer, got {optimizer!r}.',
                hint="give optim_wrapper.optimizer as a config dict, e.g. "
                "optimizer=dict(type='SGD', lr=0.1), or an Optimizer built "
                'over the model\'s parameters.')
        check_wrapper_keys(unknown)
        check_step_in_backward(step_in_backward)
        check_accumulative_counts(accumulative_counts, step_in_backward)
        clip_grad, clip_value = clip_grad_settings(clip_grad, step_in_backward)
        amp_cfg = amp_settings(amp, step_in_backward)
        self.amp = amp_cfg is not None
        self.amp_device = _param_device_type(optimizer)
        self.cast_dtype = amp_cfg.dtype if amp_cfg else None
        self._scale_update_param = amp_cfg.static_scale if amp_cfg else None
        self.loss_scaler = (
            torch.amp.GradScaler(self.amp_device, **amp_cfg.scaler_kwargs)
            if amp_cfg and amp_cfg.scaler_kwargs is not None else None)
        foreach = [(d, d['foreach'])
                   for d in [optimizer.defaults, *optimizer.param_groups]
                   if 'foreach' in d]
        try:
            make_inplace(optimizer)
            super().__init__(
                optimizer=optimizer,
                accumulative_counts=accumulative_counts,
                clip_grad=clip_grad)
            # the last step: it registers the hooks, or raises before
            self.stepper = (
                PerParameterStepper(optimizer, clip_value)
                if step_in_backward else None)
        except BaseException:
            for settings, value in foreach:  # leave the optimizer as given
                settings['foreach'] = value
            raise
        self.step_in_backward = step_in_backward
        self._step_kwargs: Dict = {}
        self._stepped_since_backward = True

    def update_params(  # type: ignore
            self,
            loss: torch.Tensor,
            step_kwargs: Optional[Dict] = None,
            zero_kwargs: Optional[Dict] = None) -> None:
        """Backward, step (if the accumulation is complete) and zero grads.

        Args:
            loss (torch.Tensor): The loss of the iteration.
            step_kwargs (dict, optional): Arguments of ``optimizer.step``
                (also of every per-parameter step).
            zero_kwargs (dict, optional): Arguments of
                ``optimizer.zero_grad``.

        Raises:
            MmdtrError: On ``zero_kwargs=dict(set_to_none=False)``, before
                anything runs (see :meth:`zero_grad`).
        """
        _refuse_zeroed_gradients(zero_kwargs or {})  # before the step
        self._step_kwargs = step_kwargs or {}
        try:
            super().update_params(loss, step_kwargs, zero_kwargs)
        except BaseException:
            # the iteration is abandoned: the next backward starts afresh
            self._stepped_since_backward = True
            raise
        finally:
            self._step_kwargs = {}

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Back-propagate ``loss`` (scaled under AMP).

        With ``step_in_backward`` every parameter steps during this call
        (one another tensor views, at its end), so a :meth:`step` must
        follow each backward.

        Args:
            loss (torch.Tensor): The loss of the iteration.
            **kwargs: Keyword arguments of :meth:`torch.Tensor.backward`.

        Raises:
            MmdtrError: With ``step_in_backward``, if the previous backward
                was not followed by :meth:`step`.
        """
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale(loss)
        if self.stepper is None:
            loss.backward(**kwargs)
        else:
            if not self._stepped_since_backward:
                raise MmdtrError(
                    'optim_wrapper.step_in_backward=True steps every '
                    'parameter during backward, so each backward must be '
                    'followed by step() (update_params does both); got two '
                    'backward calls in a row, which would accumulate.',
                    hint='for gradient accumulation use '
                    'step_in_backward=False.')
            self.stepper.begin(**self._step_kwargs)
            completed = False
            try:
                loss.backward(**kwargs)
                completed = True
            finally:
                self.stepper.end(completed)
            self._stepped_since_backward = False
        self._inner_count += 1

    def step(self, **kwargs) -> None:
        """Clip, step and set every gradient to None.

        With ``step_in_backward`` the parameters already stepped during the
        backward; ``optimizer.step()`` then only runs its hooks and steps
        parameters that still have a gradient.

        Args:
            **kwargs: Keyword arguments of ``optimizer.step``.
        """
        if self.loss_scaler is None:
            super().step(**kwargs)
        else:
            if self.clip_grad_kwargs:
                self.loss_scaler.unscale_(self.optimizer)
                self._clip_grad()
            self.loss_scaler.step(self.optimizer, **kwargs)
            self.loss_scaler.update(self._scale_update_param)
        release_grads(self.optimizer)
        self._stepped_since_backward = True

    def zero_grad(self, **kwargs) -> None:
        """Zero the gradients; with ``step_in_backward``, also forget a
        backward left without its :meth:`step` (code that raised between
        them and carries on calls this first).

        Args:
            **kwargs: Keyword arguments of ``optimizer.zero_grad``.

        Raises:
            MmdtrError: On ``set_to_none=False``: the wrapper sets every
                gradient to None after its step, so an unused parameter
                would not step where zeroed gradients step it.
        """
        _refuse_zeroed_gradients(kwargs)
        super().zero_grad(**kwargs)
        self._stepped_since_backward = True

    @contextmanager
    def optim_context(self, model: nn.Module):
        """Skip gradient sync while accumulating; autocast under AMP.

        Args:
            model (nn.Module): The training model.

        Raises:
            MmdtrError: With ``step_in_backward``, if ``model`` is a
                distributed wrapper (DDP, FSDP, DataParallel): each hook
                would step with the local, not yet reduced, gradient.
        """
        if self.stepper is not None and is_model_wrapper(model):
            raise MmdtrError(
                'optim_wrapper.step_in_backward=True cannot train the '
                f'distributed model wrapper {type(model).__name__}: each '
                'parameter would step with its local gradient before it is '
                'reduced across ranks; accepted: an unwrapped model.',
                hint='use step_in_backward=False for distributed training.')
        autocast = (
            torch.autocast(self.amp_device, dtype=self.cast_dtype)
            if self.amp else nullcontext())
        with super().optim_context(model), autocast:
            yield

    def state_dict(self) -> dict:
        """Return the optimizer's state dict (and the loss scaler's).

        Returns:
            dict: As ``OptimWrapper.state_dict``; under AMP with a loss
            scaler, plus ``'loss_scaler'``.
        """
        state_dict = super().state_dict()
        if self.loss_scaler is not None:
            state_dict['loss_scaler'] = self.loss_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this wrapper or of MMEngine's wrappers.

        The optimizer is made in-place again (a checkpoint of a plain
        optimizer stores ``foreach=None``) and the hooks are re-indexed.

        Args:
            state_dict (dict): From :meth:`state_dict`, ``OptimWrapper`` or
                ``AmpOptimWrapper``.
        """
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop('loss_scaler', None)
        if scaler_state is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        super().load_state_dict(state_dict)
        make_inplace(self.optimizer)
        if self.stepper is not None:
            self.stepper.refresh()

    def __repr__(self) -> str:
        return (super().__repr__() +
                f'step_in_backward: {self.step_in_backward}\n'
                f'amp: {self.amp} (dtype {self.cast_dtype}, loss scaler '
                f'{self.loss_scaler is not None})\n')


def _refuse_zeroed_gradients(zero_kwargs: Dict) -> None:
    """Refuse ``set_to_none=False``: the wrapper sets every gradient to None
    after its step, so a parameter without a gradient in the next iteration
    (an unused branch) would not step, where with zeroed gradients its
    weight decay and momentum step it (found by an adversarial search)."""
    if not zero_kwargs.get('set_to_none', True):
        raise MmdtrError(
            f"InplaceOptimWrapper: zero_grad(set_to_none="
            f"{zero_kwargs['set_to_none']!r}) is not accepted: the wrapper "
            'sets every gradient to None after its step (to free them), so '
            'an unused parameter would not step where zeroed gradients '
            'step it (weight decay, momentum).',
            hint='drop set_to_none (zero_kwargs), or use MMEngine\'s '
            'OptimWrapper to keep zeroed gradients.')
