"""The optimizer of an ``optim_wrapper`` config, checked when the config is
read: there at all (:func:`refuse_missing_optimizer`), and its values
(``optim_wrapper.optimizer.lr='abc'`` failed in ``torch.optim``'s
``__init__`` inside ``runner.train()``, in a raw ``TypeError``, after the
work dir was made)."""
import inspect

import torch

from mmdtr.errors import MmdtrError

#: Switches whose check depends on the device of the parameters (``fused``
#: needs a supported device, ``capturable`` CUDA): not checked on the one
#: CPU parameter the check builds.
DEVICE_SWITCHES = ('fused', 'capturable', 'foreach', 'differentiable')


def check_optimizer_values(optimizer: dict,
                           cls,
                           key: str = 'optim_wrapper.optimizer') -> None:
    """Build ``cls``, a ``torch.optim`` optimizer, over one 1x1 parameter
    with the config's values, and refuse a value it refuses (``TypeError``
    or ``ValueError``), naming the keys whose removal lets it build. Other
    optimizers, which may need the model or a process group, the switches
    in :data:`DEVICE_SWITCHES`, an optimizer that refuses the parameter
    itself (``Muon`` with no values), the first argument (the parameters,
    which MMEngine's constructor sets) and other errors are left to the
    runner.

    Args:
        optimizer (dict): ``optim_wrapper.optimizer`` (its keys checked).
        cls (type): The optimizer class it builds.
        key (str): Its config key, for messages. Defaults to
            ``'optim_wrapper.optimizer'``.

    Raises:
        MmdtrError: If the optimizer refuses a value.

    Examples:
        >>> optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.01))
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls.__module__.startswith('torch.optim')):
        return
    skipped = {'type', '_scope_', *DEVICE_SWITCHES, _first_argument(cls)}
    values = {k: v for k, v in optimizer.items() if k not in skipped}
    error = _refusal(cls, values)
    if error is None or not values or _refusal(cls, {}) is not None:
        return  # accepted, or the probe parameter is what it refuses
    culprits = [
        k for k in values if _refusal(cls, {
            j: v
            for j, v in values.items() if j != k
        }) is None
    ] or list(values)
    shown = ', '.join(f'{key}.{k}={values[k]!r}' for k in culprits)
    raise MmdtrError(
        f'{shown}: not accepted by torch.optim.{cls.__name__}, which '
        f'raised {type(error).__name__}: {error}',
        hint=f'change {" or ".join(culprits)} to a value '
        f'{cls.__name__} takes (see help(torch.optim.{cls.__name__})); '
        'the runner would build it with these values in train().')


def _first_argument(cls) -> str:
    """The name of the parameters' argument, which MMEngine's constructor
    sets (``params``)."""
    try:
        names = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return 'params'
    return names[1] if len(names) > 1 else 'params'


def _refusal(cls, values: dict):
    """The ``TypeError`` or ``ValueError`` ``cls`` raises built with
    ``values`` over one 1x1 parameter (2-D: ``Muon`` takes no other), or
    ``None``."""
    needs_lr = 'lr' not in values and _lr_required(cls)
    kwargs = dict(values, lr=0.01) if needs_lr else values
    try:
        cls([torch.zeros(1, 1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as error:
        return error
    except Exception:  # noqa: B902 (not a value's fault: left to the runner)
        return None
    return None


def _lr_required(cls) -> bool:
    try:
        param = inspect.signature(cls.__init__).parameters.get('lr')
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def refuse_missing_optimizer(optim_wrapper: dict) -> None:
    """MMEngine builds one wrapper from ``optim_wrapper.optimizer``; a dict
    without it and without a constructor must hold wrappers already built,
    one per optimizer, and the default constructor asserts it is there.
    Anything else failed in ``runner.train()``, in a ``ValueError`` about
    "optimizer objects" (found by an adversarial search:
    ``dict(type='InplaceOptimWrapper', step_in_backward=True)``,
    ``dict(accumulative_counts=2)``)."""
    from mmengine.optim import OptimWrapper
    if 'optimizer' in optim_wrapper or ('constructor' not in optim_wrapper
                                        and all(
                                            isinstance(w, OptimWrapper)
                                            for w in optim_wrapper.values())):
        return
    raise MmdtrError(
        f'optim_wrapper={optim_wrapper!r} has no optimizer: MMEngine builds '
        'the wrapper around optim_wrapper.optimizer (a dict without it, and '
        'without a constructor, is read as wrappers already built, one per '
        'optimizer).',
        hint="add one, e.g. optimizer=dict(type='SGD', lr=0.01) "
        '(--cfg-options optim_wrapper.optimizer.type=SGD '
        'optim_wrapper.optimizer.lr=0.01); for several optimizers, name a '
        "constructor (constructor='MultiOptimWrapperConstructor') and give "
        'one wrapper config per optimizer.')
