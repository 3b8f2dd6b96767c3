"""In-place parameter updates, optionally fused into the backward (torch only).

MegEngine's ``INPLACE_UPDATE`` updates each parameter and its optimizer
state in place, one tensor at a time. In PyTorch terms:

- :func:`make_inplace` turns the ``foreach`` implementation of a
  ``torch.optim`` optimizer off (``foreach=False``). A foreach step runs
  every op on the whole parameter list at once and so allocates transient
  copies of the whole list (e.g. Adam's ``sqrt`` of every second moment);
  the single-tensor loop updates one parameter at a time, and its
  temporaries are at most the size of one parameter. ``fused=True``, when
  the optimizer was built with it, is kept: fused kernels are in place too.
- :func:`release_grads` frees the gradients after the step.
- :class:`PerParameterStepper` applies the optimizer's update to each
  parameter from a ``Tensor.register_post_accumulate_grad_hook`` hook, as
  soon as its gradient is complete, and frees that gradient at once, so the
  gradients of all parameters are never alive together.

A per-parameter step runs the optimizer's own ``step`` on a parameter group
restricted to the one parameter, with the group's current hyper-parameters
(learning rate set by a scheduler, weight decay, momentum) and the
optimizer's own ``state``: the result is bit-identical to the single-tensor
loop over all parameters, and ``optimizer.state_dict()`` is unchanged.
"""
import contextlib
import threading
from typing import Callable, Dict, List, Optional, Set

import torch
from torch.optim import Optimizer

from mmdtr.core.torch_compat import STORAGE_OBJECT_USES
from mmdtr.errors import MmdtrError

#: Optimizers whose update is not per-parameter (they need a closure or a
#: view of every parameter at once).
NOT_PER_PARAMETER = (torch.optim.LBFGS, )


def make_inplace(optimizer: Optimizer) -> None:
    """Make a ``torch.optim`` optimizer step one parameter at a time.

    Sets ``foreach=False`` in ``optimizer.defaults`` and every parameter
    group of optimizers that have a ``foreach`` option; ``fused=True`` is
    kept. Optimizers without a ``foreach`` option are left unchanged.
    Idempotent; call it again after ``load_state_dict``, which restores the
    saved groups' ``foreach``.

    Args:
        optimizer (Optimizer): The optimizer, modified in place.

    Raises:
        MmdtrError: If the optimizer was built with ``foreach=True``.

    Examples:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> make_inplace(opt)
        >>> opt.param_groups[0]['foreach']
        False
    """
    if 'foreach' not in optimizer.defaults:
        return
    if optimizer.defaults['foreach']:
        raise foreach_refused(
            type(optimizer).__name__, optimizer.defaults['foreach'])
    optimizer.defaults['foreach'] = False
    for group in optimizer.param_groups:
        group['foreach'] = False


def foreach_refused(optimizer_name: str, value=True) -> MmdtrError:
    """The error for an optimizer built (or configured) with
    ``foreach=True`` (``value``, as given), which in-place updates
    refuse."""
    return MmdtrError(
        f'optimizer.foreach={value!r} ({optimizer_name}) allocates transient '
        'copies of the whole parameter list at every step; in-place updates '
        'accept foreach=None or False.',
        hint='drop foreach from the optimizer config (fused=True is '
        'accepted where torch supports it).')


def not_per_parameter_refused(optimizer_name: str) -> MmdtrError:
    """The error for ``step_in_backward=True`` with an optimizer of
    :data:`NOT_PER_PARAMETER`."""
    return MmdtrError(
        'step_in_backward=True needs an optimizer that updates each '
        f'parameter on its own; got {optimizer_name}, which needs a closure '
        'over every parameter.',
        hint='use step_in_backward=False with this optimizer.')


def release_grads(optimizer: Optimizer) -> None:
    """Set the gradient of every parameter of ``optimizer`` to None.

    Args:
        optimizer (Optimizer): The optimizer whose parameters are released.
    """
    for group in optimizer.param_groups:
        for param in group['params']:
            param.grad = None


def raw_step(optimizer: Optimizer) -> Callable:
    """Return the optimizer's ``step`` without its step pre/post hooks.

    ``torch.optim.Optimizer`` wraps the ``step`` of each optimizer class in a
    function that runs the registered step hooks; MMEngine's parameter
    schedulers also wrap ``optimizer.step`` to count calls. Per-parameter
    steps call the unwrapped function, so hooks and counters run once per
    iteration, from the full ``optimizer.step()``.

    Args:
        optimizer (Optimizer): The optimizer.

    Returns:
        Callable: ``step(optimizer, **kwargs)``.
    """
    step = type(optimizer).step
    if getattr(step, 'hooked', False):
        step = step.__wrapped__
    return step


def _hooked_below(optimizer: Optimizer) -> bool:
    """Whether a base class's ``step`` is hooked too: a subclass's step
    that calls ``super().step()`` then runs the step hooks itself."""
    return any(
        getattr(vars(klass).get('step'), 'hooked', False)
        for klass in type(optimizer).__mro__[1:])


@contextlib.contextmanager
def _step_hooks_off(optimizer: Optimizer):
    """No step hooks, the optimizer's and the global ones, while it runs,
    when a base class's hooked ``step`` would run them (emptied in place,
    so that their handles stay valid, and put back)."""
    if not _hooked_below(optimizer):
        yield
        return
    from torch.optim import optimizer as module
    hooks = (optimizer._optimizer_step_pre_hooks,
             optimizer._optimizer_step_post_hooks,
             module._global_optimizer_pre_hooks,
             module._global_optimizer_post_hooks)
    saved = [dict(h) for h in hooks]
    for h in hooks:
        h.clear()
    try:
        yield
    finally:
        for h, items in zip(hooks, saved):
            h.update(items)


class PerParameterStepper:
    """Step each parameter from its post-accumulate-grad hook.

    Hooks are registered on every parameter of ``optimizer`` that requires
    grad. They only act between :meth:`begin` and :meth:`end` (one backward
    pass); outside, gradients accumulate as usual. When a hook fires, the
    parameter's gradient is complete: a parameter used several times in the
    forward (tied weights) gets its hook once, after the last contribution.
    The hook optionally clamps the gradient (``clip_value``, the same as
    :func:`torch.nn.utils.clip_grad_value_`), steps the parameter and sets
    its gradient to None. Parameters that get no gradient are not stepped,
    as in ``optimizer.step()``.

    A parameter whose storage another tensor still views when its hook
    fires steps at :meth:`end` instead: autograd runs the hook after the
    nodes that give the parameter a gradient, not after those that read it
    without one (``weight.detach()`` or ``weight.data`` in the forward, a
    stop-gradient use), so one of those could still read it. Unsure means
    later: such a view is usually a saved tensor of a node yet to run (or
    an engine's recipe), and the step after the backward is what
    ``optimizer.step()`` would do.

    Every parameter may step once per :meth:`begin`: a second hook call in
    the same backward means the gradient arrived in pieces (e.g. reentrant
    activation checkpointing of a shared parameter, or ``backward`` of
    parts of the graph), and an :class:`MmdtrError` is raised instead of
    stepping with a partial gradient.

    Args:
        optimizer (Optimizer): A per-parameter optimizer (not LBFGS).
        clip_value (float, optional): Clamp every gradient to
            ``[-clip_value, clip_value]`` before its step. Defaults to None.

    Examples:
        >>> stepper = PerParameterStepper(optimizer)
        >>> stepper.begin()
        >>> loss.backward()  # every parameter steps as its grad completes
        >>> stepper.end()
    """

    def __init__(self,
                 optimizer: Optimizer,
                 clip_value: Optional[float] = None):
        if isinstance(optimizer, NOT_PER_PARAMETER):
            raise not_per_parameter_refused(type(optimizer).__name__)
        self.optimizer = optimizer
        self.clip_value = clip_value
        self.step_kwargs: dict = {}
        self.active = False
        self.steps_taken = 0
        self._step = raw_step(optimizer)
        self._lock = threading.Lock()
        self._hooked: Set[int] = set()
        self._handles: list = []
        self._group_of: Dict[int, dict] = {}
        self._stepped: Set[int] = set()
        self._deferred: List[torch.Tensor] = []
        self.refresh()

    def refresh(self) -> None:
        """Re-index the parameter groups and hook new parameters.

        Call it when parameter groups change (``add_param_group``,
        ``load_state_dict``); :meth:`begin` calls it.
        """
        group_of = {}
        for group in self.optimizer.param_groups:
            for param in group['params']:
                group_of.setdefault(id(param), group)
                if param.requires_grad and id(param) not in self._hooked:
                    self._handles.append(
                        param.register_post_accumulate_grad_hook(self._hook))
                    self._hooked.add(id(param))
        self._group_of = group_of

    def begin(self, **step_kwargs) -> None:
        """Step parameters from their hooks until :meth:`end`.

        Args:
            **step_kwargs: Keyword arguments of each per-parameter step.
        """
        self.refresh()
        self.step_kwargs = step_kwargs
        self._stepped.clear()
        self._deferred = []
        self.steps_taken = 0
        self.active = True

    def end(self, completed: bool = True) -> None:
        """Stop stepping from hooks; gradients accumulate as usual.

        Args:
            completed (bool): The backward returned: the parameters whose
                step was put off step now. False after a backward that
                raised: they keep their gradients, unstepped, as those not
                reached. Defaults to True.
        """
        self.active = False
        deferred, self._deferred = self._deferred, []
        for param in deferred if completed else ():
            if param.grad is not None:
                self._step_now(param)

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._hooked = [], set()
        self.active = False

    def step_param(self, param: torch.Tensor) -> None:
        """Apply the optimizer's update to ``param`` alone.

        Runs the optimizer's ``step`` with ``param_groups`` set to the
        parameter's own group, whose ``params`` is ``[param]`` for the
        duration; hyper-parameters are read live from that group.

        Args:
            param (Tensor): A parameter of the optimizer with a gradient.
        """
        group = self._group_of[id(param)]
        with self._lock:
            groups, params = self.optimizer.param_groups, group['params']
            group['params'] = [param]
            self.optimizer.param_groups = [group]
            try:
                with torch.no_grad(), _step_hooks_off(self.optimizer):
                    self._step(self.optimizer, **self.step_kwargs)
            finally:
                group['params'] = params
                self.optimizer.param_groups = groups

    def _hook(self, param: torch.Tensor) -> None:
        if not self.active or id(param) not in self._group_of:
            return
        if param.grad is None:  # pragma: no cover - autograd sets it
            return
        if id(param) in self._stepped:
            raise MmdtrError(
                f'step_in_backward=True: a parameter of shape '
                f'{tuple(param.shape)} received its gradient twice in one '
                'backward (reentrant activation checkpointing of a shared '
                'parameter, or backward over parts of the graph), so it '
                'already stepped with a partial gradient.',
                hint='use non-reentrant checkpointing (use_reentrant=False) '
                'or step_in_backward=False.')
        self._stepped.add(id(param))
        if _viewed_elsewhere(param):
            self._deferred.append(param)  # stepped at end() (found by a
            return  # review: a stop-gradient read ran on the new values)
        self._step_now(param)

    def _step_now(self, param: torch.Tensor) -> None:
        if self.clip_value is not None:
            param.grad.clamp_(-self.clip_value, self.clip_value)
        self.step_param(param)
        param.grad = None
        self.steps_taken += 1


def _viewed_elsewhere(param: torch.Tensor) -> bool:
    """Whether a tensor other than ``param`` views its storage (its use
    count beyond ``param`` and its unreferenced Python object)."""
    cdata = param.untyped_storage()._cdata  # the object is let go here
    return torch._C._storage_Use_Count(cdata) > 1 + STORAGE_OBJECT_USES
