"""The values of a PyTorch optimizer's config, checked when the config is
read: ``optim_wrapper.optimizer.lr='abc'`` failed in ``torch.optim``'s
``__init__`` inside ``runner.train()``, in a raw ``TypeError``, after the
work dir was made."""
import inspect

import torch

from mmdtr.errors import MmdtrError

#: Switches whose check depends on the device of the parameters (``fused``
#: needs a supported device, ``capturable`` CUDA): not checked on the one
#: CPU parameter the check builds.
DEVICE_SWITCHES = ('fused', 'capturable', 'foreach', 'differentiable')


def check_optimizer_values(optimizer: dict, cls) -> None:
    """Build ``cls``, a ``torch.optim`` optimizer, over one parameter with
    the config's values, and refuse a value it refuses (``TypeError`` or
    ``ValueError``), naming the key. Other optimizers, which may need the
    model or a process group, the switches in :data:`DEVICE_SWITCHES` and
    other errors are left to the runner.

    Args:
        optimizer (dict): ``optim_wrapper.optimizer`` (its keys checked).
        cls (type): The optimizer class it builds.

    Raises:
        MmdtrError: If the optimizer refuses a value.

    Examples:
        >>> optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.01))
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls.__module__.startswith('torch.optim')):
        return
    values = {
        k: v
        for k, v in optimizer.items()
        if k not in ('type', '_scope_') and k not in DEVICE_SWITCHES
    }
    error = _refusal(cls, values)
    if error is None:
        return
    # the key that alone is refused, else all of them
    culprits = [k for k in values if _refusal(cls, {k: values[k]})] or \
        list(values)
    shown = ', '.join(f'{k}={values[k]!r}' for k in culprits)
    raise MmdtrError(
        f'optim_wrapper.optimizer.{shown} is not accepted by '
        f'{cls.__name__}: {type(error).__name__}: {error}',
        hint=f'give {cls.__name__} the values torch.optim accepts '
        "(numbers, e.g. lr=0.01), as in optimizer=dict(type='"
        f"{cls.__name__}', lr=0.01).")


def _refusal(cls, values: dict):
    """The ``TypeError`` or ``ValueError`` ``cls`` raises built with
    ``values`` over one parameter, or ``None``."""
    needs_lr = 'lr' not in values and _lr_required(cls)
    kwargs = dict(values, lr=0.01) if needs_lr else values
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
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
