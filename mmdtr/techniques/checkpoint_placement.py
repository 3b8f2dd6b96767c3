"""Where a selected module cannot be checkpointed (torch only): inside a
module whose forward a torch.fx trace replaced and inlines it, or as the
conv of an mmcv ``ConvModule`` whose own efficient Conv-BN eval is on.
"""
from typing import Optional, Sequence

import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError

#: attribute of a checkpointed module holding the forward it wraps, if the
#: module had one of its own (a torch.fx trace's, say)
ORIG_FORWARD = '_mmdtr_ckpt_inner_forward'


def refuse_unreachable(model: nn.Module, names: Sequence[str]) -> None:
    """Refuse modules of ``model`` whose checkpoint would never run.

    Args:
        model (nn.Module): The model.
        names (Sequence[str]): The modules selected, by qualified name.

    Raises:
        MmdtrError: On a module inlined by a torch.fx trace of an ancestor,
            or the conv of a ``ConvModule`` that fuses it itself.
    """
    for name in names:
        _refuse_fused_conv(model, name)
        ancestor = _inlined_by(model, name)
        if ancestor is not None:
            where = repr(ancestor) if ancestor else 'the model'
            raise MmdtrError(
                f'activation_checkpointing: module {name!r} lies inside '
                f'{where}, whose forward was replaced by a torch.fx trace '
                '(efficient_conv_bn_eval) that inlines it, so it cannot be '
                'checkpointed. Accepted: modules the trace calls as '
                'modules, or the traced module itself.',
                hint=f'checkpoint {where} instead.')


def _traced_graph(module: nn.Module) -> Optional[torch.fx.Graph]:
    """The graph of ``module``'s forward if a torch.fx trace replaced it."""
    forward = module.__dict__.get(ORIG_FORWARD, module.__dict__.get('forward'))
    owner = getattr(forward, 'graph_module', None)  # a guarded trace
    owner = owner or getattr(forward, '__self__', None)
    return owner.graph if isinstance(owner, torch.fx.GraphModule) else None


def _inlined_by(model: nn.Module, name: str) -> Optional[str]:
    """Name of the fx-traced ancestor that inlines ``name``, else None."""
    parts = name.split('.')
    for i in range(len(parts) - 1, -1, -1):
        ancestor = '.'.join(parts[:i])
        graph = _traced_graph(model.get_submodule(ancestor))
        if graph is None:
            continue
        called = {n.target for n in graph.nodes if n.op == 'call_module'}
        rest = parts[i:]
        if any('.'.join(rest[:j]) in called for j in range(1, len(rest) + 1)):
            return _inlined_by(model, ancestor) if ancestor else None
        return ancestor
    return None


def _refuse_fused_conv(model: nn.Module, name: str) -> None:
    """Refuse the conv of an mmcv ``ConvModule`` whose own efficient Conv-BN
    eval is on: its forward sets the conv's ``forward`` to the fused form
    and then deletes it, which deleted the checkpoint too (found by an
    adversarial search: checkpointed at the first iteration only)."""
    path, _, child = name.rpartition('.')
    parent = model.get_submodule(path) if child == 'conv' else None
    if getattr(parent, 'efficient_conv_bn_eval_forward', None) is None:
        return
    raise MmdtrError(
        f'activation_checkpointing: module {name!r} is the conv of a '
        f'{type(parent).__name__} whose own efficient Conv-BN eval is on '
        '(efficient_conv_bn_eval); its forward replaces the conv\'s forward '
        'by the fused form and then deletes it, which would drop the '
        'checkpoint after the first call.',
        hint=f'checkpoint {path!r} (the whole module) instead.')
