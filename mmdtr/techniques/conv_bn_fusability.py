"""Which Conv and BatchNorm the fused form of efficient Conv-BN eval computes
exactly as the modules would (torch only).

The fused form (``fused(bn, conv, x)``) calls ``conv._conv_forward`` and
reads the BN's statistics itself, so a module whose call does more than its
``torch.nn`` class does is left unfused: checked when the pairs are fused,
and at each call of a fused trace (:class:`StillFusable`).
"""
from typing import Optional

import torch.nn as nn
import torch.nn.modules.module as module_hooks
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

#: Forwards of subclasses that compute what torch's own do: mmcv's
#: ``Conv2d`` and ``Conv3d`` wrappers (registered as ``'Conv'`` and
#: ``'Conv3d'``) only add a path for empty inputs on torch < 1.4.
SAME_AS_TORCH = frozenset({
    ('mmcv.cnn.bricks.wrappers', 'Conv2d.forward'),
    ('mmcv.cnn.bricks.wrappers', 'Conv3d.forward'),
})

#: torch's hooks on every module (``register_module_forward_hook``...)
_GLOBAL_HOOKS = (module_hooks._global_forward_hooks,
                 module_hooks._global_forward_pre_hooks,
                 module_hooks._global_backward_hooks,
                 module_hooks._global_backward_pre_hooks)


def _runs_as_torch(module: nn.Module) -> bool:
    """Whether calling ``module`` does only what its ``torch.nn`` class
    does. The fused form calls ``conv._conv_forward`` and reads the BN's
    statistics itself, so a subclass's own forward (mmcv's ``ConvWS2d``
    standardizes its weight) or a hook (old-style ``weight_norm``, a
    feature recorder) would be skipped."""
    forward = type(module).forward
    return (
        (forward.__module__.startswith('torch.nn.') or
         (forward.__module__, forward.__qualname__) in SAME_AS_TORCH)
        and not (module._forward_hooks or module._forward_pre_hooks
                 # a Grad-CAM hook; hooks on every module (found by a
                 # review)
                 or module._backward_hooks or
                 module._backward_pre_hooks or any(_GLOBAL_HOOKS))
        and 'forward' not in vars(module)  # checkpointed, or wrapped
        # a parametrization (spectral_norm) runs at each read of the
        # weight, which the fused form reads twice: two power
        # iterations per call (found by an adversarial search)
        and 'parametrizations' not in module._modules)


def fusable_conv(module: Optional[nn.Module]) -> bool:
    """A Conv the fused form computes exactly as the module would."""
    return (isinstance(module, _ConvNd) and not module.transposed
            and _runs_as_torch(module))


def fusable_bn(module: Optional[nn.Module]) -> bool:
    """A BatchNorm the fused form can fold (running statistics, torch's
    own forward)."""
    return (isinstance(module, _BatchNorm) and module.track_running_stats
            and module._buffers.get('running_var') is not None
            and _runs_as_torch(module))


class StillFusable:
    """A guard of a fused trace: its Conv and BN are still as
    :func:`fusable_conv` and :func:`fusable_bn` require. A hook added
    since (a feature recorder), statistics dropped (``running_var=None``,
    TENT-style adaptation) or a parametrization would be skipped by, or
    break, the fused form (found by an adversarial search)."""
    __slots__ = ('conv', 'bn')

    def __init__(self, conv: nn.Module, bn: nn.Module):
        self.conv, self.bn = conv, bn

    def holds(self) -> bool:
        return fusable_conv(self.conv) and fusable_bn(self.bn)
