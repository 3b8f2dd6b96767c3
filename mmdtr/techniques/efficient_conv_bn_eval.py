"""Efficient Conv-BN eval: fold eval-mode BatchNorm into its conv (torch only).

When a BatchNorm in eval mode (frozen statistics, e.g. ``norm_eval=True``
in detection backbones) follows a convolution, ``bn(conv(x))`` equals a
single convolution with a rescaled weight and a shifted bias ("Tune-Mode
ConvBN Blocks For Efficient Transfer Learning", arXiv:2305.11624). The
fused form does not keep the conv output for the BatchNorm's backward, so
each fused pair saves one activation of memory during training, and the
gradients of the conv weight and the BN affine parameters are unchanged up
to floating-point rounding. In training mode the fused function falls back
to ``bn(conv(x))``, so switching modes stays correct.

This module finds the pairs and rewires the graph; the fused computation
itself is supplied by the caller (the MMEngine adapter passes
``mmengine.model.efficient_conv_bn_eval.efficient_conv_bn_eval_control``),
and so is ``native``, which turns on a module type's own support (mmcv's
``ConvModule.turn_on_efficient_conv_bn_eval``).

Pairs are found with ``torch.fx``, one module at a time: only the modules
that directly own a Conv and a BatchNorm are traced, and in each trace every
child module with a forward of its own stays a call (a leaf). So a trace
bakes in only that module's own Python code (a ``self.training`` branch of a
child stays live; a module whose own code reads a training flag is traced
in both modes and left unfused if they differ), a trace failure
(data-dependent control flow) is confined to the module whose own code
causes it and is reported with the reason, and activation checkpointing
can wrap any module, before or after. The price: a Conv in one child whose
output feeds a BatchNorm in another stays unfused.

Compared with MMEngine's ``efficient_conv_bn_eval_graph_transform``, the
pair search also skips (instead of raising ``KeyError`` on) BatchNorms whose
input is not a module call (a BN on the input, after an add or a concat),
transposed convolutions (whose weight layout the fused form does not handle),
BatchNorms without running statistics, and Convs or BatchNorms whose call
does more than their ``torch.nn`` class (a subclass's own forward, a hook),
which the fused form would skip.
"""
import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from .activation_checkpointing import (inner_forward, is_checkpointed,
                                       replace_forward)
from .code_guards import TypeWatchingTracer, guard_code
from .conv_bn_fusability import StillFusable, fusable_bn, fusable_conv
from .guard_values import TraceRefused
from .module_selection import outermost, resolve_modules
from .traced_forward import GuardedForward, watched_trace

#: ``fused(bn, conv, x) -> Tensor``: ``bn(conv(x))`` in the fused form.
FusedForward = Callable[[_BatchNorm, _ConvNd, torch.Tensor], torch.Tensor]
#: ``native(module) -> bool``: enable a module's own support, True if done.
NativeSupport = Callable[[nn.Module], bool]


@dataclass
class ConvBnEvalResult:
    """What :func:`apply_efficient_conv_bn_eval` did to one module.

    Args:
        name (str): The selected module's name.
        fused_pairs (int): Conv+BN pairs rewired in torch.fx traces.
        native_modules (int): Sub-modules whose own support was turned on.
        traced (list[str]): Modules whose forward is now a trace.
        failures (list[tuple[str, str]]): ``(module name, reason)`` for each
            module whose tracing failed.
    """

    name: str
    fused_pairs: int = 0
    native_modules: int = 0
    traced: List[str] = field(default_factory=list)
    failures: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        """Whether at least one Conv+BN pair runs in the fused form."""
        return bool(self.fused_pairs or self.native_modules)


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _modes() -> tuple:
    """Grad mode and autocast now: a trace runs a ``with torch.no_grad()``
    or ``torch.autocast(...)`` block of the forward but records nothing of
    it, so the traced forward would run its ops outside it."""
    autocast_dtype = getattr(torch, 'get_autocast_dtype', None)
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch._C._is_any_autocast_enabled(),
            autocast_dtype('cpu') if autocast_dtype else None)


class _ConvBnTracer(TypeWatchingTracer):
    """Trace one module's own code: every child with a forward is a leaf.
    ``switches_modes``: whether a node was made under other grad or
    autocast modes than the trace started in."""

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return _has_forward(m)

    def trace(self, root, concrete_args=None):
        self.start, self.switches_modes = _modes(), False
        return super().trace(root, concrete_args)

    def create_node(self, *args, **kwargs):
        self.switches_modes |= _modes() != self.start
        return super().create_node(*args, **kwargs)


def _is_layer(module: nn.Module) -> bool:
    """A torch.nn layer with its own forward (not a bare container)."""
    return _has_forward(module) and fx.Tracer().is_leaf_module(module, '')


def _own_layers(module: nn.Module):
    """Children called by ``module``'s own code, seen through containers."""
    for child in module.children():
        if _has_forward(child):
            yield child
        else:  # ModuleList, ModuleDict, a bare nn.Module
            yield from _own_layers(child)


def find_conv_bn_pairs(gm: fx.GraphModule) -> List[Tuple[fx.Node, fx.Node]]:
    """Find ``bn(conv(x))`` call pairs whose conv output has no other user.

    Args:
        gm (fx.GraphModule): A traced module.

    Returns:
        list[tuple[fx.Node, fx.Node]]: ``(conv node, bn node)`` pairs.
    """
    modules = dict(gm.named_modules())
    pairs = []
    for node in gm.graph.nodes:
        if (node.op != 'call_module' or len(node.args) != 1 or node.kwargs
                or not fusable_bn(modules.get(node.target))):
            continue
        source = node.args[0]
        if (isinstance(source, fx.Node) and source.op == 'call_module'
                and len(source.args) == 1 and not source.kwargs
                and len(source.users) == 1
                and fusable_conv(modules.get(source.target))):
            pairs.append((source, node))
    return pairs


def fuse_conv_bn_pairs(gm: fx.GraphModule,
                       fused: FusedForward) -> List[Tuple[str, str]]:
    """Replace each Conv+BN pair of ``gm`` by ``fused(bn, conv, x)``.

    Args:
        gm (fx.GraphModule): A traced module, changed in place.
        fused (FusedForward): The fused computation.

    Returns:
        list[tuple[str, str]]: The names of the Conv and BN of each pair
        replaced.
    """
    pairs = find_conv_bn_pairs(gm)
    graph = gm.graph
    for conv_node, bn_node in pairs:
        with graph.inserting_before(conv_node):
            conv = graph.get_attr(conv_node.target)
            bn = graph.get_attr(bn_node.target)
            node = graph.call_function(fused, (bn, conv, conv_node.args[0]))
        bn_node.replace_all_uses_with(node)
        graph.erase_node(bn_node)
        graph.erase_node(conv_node)
    if pairs:
        graph.lint()
        gm.recompile()
    return [(conv.target, bn.target) for conv, bn in pairs]


def _trace_in_both_modes(module: nn.Module) -> Tuple[fx.Graph, bool, bool]:
    """Trace ``module`` with every ``training`` flag in it set to True,
    then to False (the flags are put back; no ``train()`` override runs).
    Returns the first graph, whether the two differ (a trace bakes in what
    its code reads of the flags: ``F.dropout(x, training=
    self.training)``, which the hook, applied in one mode, would fix), and
    whether the forward switches grad mode or autocast (seen in the first
    trace, run as called, or the second, run under ``no_grad`` and CPU
    autocast, so that a block switching either on or off is seen), and the
    module's plain attributes its code read (:func:`.watched_trace`)."""
    flags = [(m, m.training) for m in module.modules()]
    codes, switches, reads = [], False, {}
    try:
        for mode in (True, False):
            for m, _ in flags:
                m.training = mode
            tracer = _ConvBnTracer()
            with contextlib.ExitStack() as stack:
                if not mode:
                    stack.enter_context(torch.no_grad())
                    stack.enter_context(
                        torch.autocast('cpu', dtype=torch.bfloat16))
                graph, read = watched_trace(module, tracer)
            reads.update(read)
            switches |= tracer.switches_modes
            codes.append(graph.python_code('self').src)
            if mode:
                first = graph
    finally:
        for m, training in flags:
            m.training = training
    return first, codes[0] != codes[1], switches, reads


def _trace_and_fuse(module: nn.Module, name: str, fused: FusedForward,
                    result: ConvBnEvalResult) -> None:
    # the forward that runs: beneath mmdtr's checkpoint, or as called
    inner = inner_forward(module) if is_checkpointed(module) else \
        module.forward
    if getattr(inner, '__func__', None) is not type(module).forward or \
            getattr(inner, '__self__', None) is not module:  # a wrapper
        # found by an adversarial search: MMEngine's checkpointing was lost
        result.failures.append(
            (name, "its forward is replaced on the module (by MMEngine's "
             'activation checkpointing or another wrapper), which a trace of '
             "its class's forward would drop"))
        return
    try:
        # first: a forward that writes a global is refused before its code
        # runs in a trace (found by a review)
        code_guards = guard_code(module)
        graph, mode_dependent, switches, reads = _trace_in_both_modes(module)
    except TraceRefused as exc:
        result.failures.append((name, str(exc)))
        return
    except Exception as exc:  # any trace failure: report it, go on
        first_line = (str(exc).strip().splitlines() or [''])[0]
        result.failures.append(
            (name, f'torch.fx tracing failed ({type(exc).__name__}: '
             f'{first_line})'))
        return
    if mode_dependent:
        result.failures.append((name, 'its own forward reads a training flag '
                                '(self.training), which a trace would fix'))
        return
    if switches:  # found by an adversarial search: gradients differed
        result.failures.append(
            (name, 'its own forward switches grad mode or autocast '
             '(torch.no_grad(), torch.autocast(...)), which a trace would '
             'drop'))
        return
    gm = fx.GraphModule(module, graph, class_name=type(module).__name__)
    pairs = fuse_conv_bn_pairs(gm, fused)
    if not pairs:
        return
    code_guards += [
        StillFusable(module.get_submodule(conv), module.get_submodule(bn))
        for conv, bn in pairs
    ]
    try:  # the trace runs only while what it read holds (found by an
        # adversarial search: a supernet's choice, identity=None, baked in)
        forward = GuardedForward(module, gm.forward, inner, reads, code_guards)
    except TraceRefused as exc:
        result.failures.append((name, str(exc)))
        return
    replace_forward(module, forward)
    result.fused_pairs += len(pairs)
    result.traced.append(name)


def _fuse_subtree(module: nn.Module, name: str, fused: FusedForward,
                  native: Optional[NativeSupport],
                  result: ConvBnEvalResult) -> None:
    if native is not None and native(module):
        result.native_modules += 1
        return
    if _is_layer(module):
        return
    layers = list(_own_layers(module))
    if (_has_forward(module) and any(map(fusable_conv, layers))
            and any(map(fusable_bn, layers))):
        _trace_and_fuse(module, name, fused, result)
    for child_name, child in module.named_children():
        _fuse_subtree(child, f'{name}.{child_name}', fused, native, result)


def _explain(result: ConvBnEvalResult) -> Optional[str]:
    failed = '; '.join(f'{name!r}: {why}' for name, why in result.failures[:3])
    if len(result.failures) > 3:
        failed += f'; and {len(result.failures) - 3} more'
    if not result.enabled:
        why = failed or (
            'no module in it calls a Conv (not transposed) whose output '
            'feeds only a BatchNorm with running statistics, both running '
            "torch's own forward without hooks")
        return ('efficient_conv_bn_eval: no Conv+BN pair was fused in '
                f'module {result.name!r}, it runs unchanged. Why: {why}.')
    if failed:
        return (f'efficient_conv_bn_eval: module {result.name!r} is only '
                'partly fused; the Conv+BN pairs of sub-modules that could '
                f'not be traced run unfused. Why: {failed}.')
    return None


def apply_efficient_conv_bn_eval(model: nn.Module,
                                 modules: Union[str, Sequence[str]],
                                 fused: FusedForward,
                                 native: Optional[NativeSupport] = None
                                 ) -> List[ConvBnEvalResult]:
    """Fuse eval-mode Conv+BN pairs inside the named sub-modules.

    Every name is checked before anything changes. Sub-modules for which
    ``native`` returns True keep their own support and are not traced. A
    ``UserWarning`` names each selected module left unfused, or partly
    fused, and says why. Activation checkpointing may be applied before or
    after, on any module.

    Args:
        model (nn.Module): The model (unwrap DDP first: pass ``.module``).
        modules (str | Sequence[str]): Sub-module names or glob patterns on
            ``model.named_modules()``, e.g. ``'backbone'``.
        fused (FusedForward): ``fused(bn, conv, x)``, e.g. MMEngine's
            ``efficient_conv_bn_eval_control``.
        native (NativeSupport, optional): Turns on a module's own support;
            returns whether it did.

    Returns:
        list[ConvBnEvalResult]: One per selected (outermost) module.

    Raises:
        MmdtrError: If a name or pattern matches no sub-module.

    Examples:
        >>> from mmengine.model.efficient_conv_bn_eval import \\
        ...     efficient_conv_bn_eval_control
        >>> apply_efficient_conv_bn_eval(
        ...     model, ['backbone'], efficient_conv_bn_eval_control)
    """
    found = resolve_modules(model, modules, key='efficient_conv_bn_eval')
    results = []
    for name in outermost(list(found)):
        module = found[name]
        result = ConvBnEvalResult(name)
        if _is_layer(module):
            result.failures.append(
                (name, f'it is a single layer ({type(module).__name__}), '
                 'not a module containing Conv+BN pairs'))
        else:
            _fuse_subtree(module, name, fused, native, result)
        message = _explain(result)
        if message:
            warnings.warn(message, UserWarning, stacklevel=2)
        results.append(result)
    return results
