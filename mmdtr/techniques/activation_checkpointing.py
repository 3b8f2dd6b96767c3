"""Activation checkpointing of selected sub-modules (torch only).

The forward of each selected module runs under
:func:`torch.utils.checkpoint.checkpoint` with ``use_reentrant=False``: its
intermediate activations are dropped after the forward and recomputed during
the backward. Compared with MMEngine's ``turn_on_activation_checkpointing``
(reentrant, positional arguments only):

- keyword arguments pass through, and tensors given by keyword have their
  device RNG state preserved like positional ones;
- parameters get gradients even when no input requires grad (a backbone fed
  images), which the reentrant variant silently skips;
- a selective policy keeps the outputs of compute-heavy ops (matmuls,
  convolutions, attention) and recomputes only the cheap ones, through
  :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`;
- normalization layers (BatchNorm, InstanceNorm with running stats) update
  their running statistics once, in the forward; the recompute normalizes
  with the same batch statistics but writes into throw-away copies of the
  running buffers, so outputs, gradients and buffers are bit-identical to
  the plain model (:mod:`.recompute_guards`); a module that updates any
  other buffer in its forward is refused, as is one that writes its input
  in place: their recompute would read the updated values;
- the recompute runs in full (no early stop), so an op that writes a
  tensor after saving it (``rrelu``'s noise) is replayed whole;
- ``torch.Generator`` s held by the module and its descendants, or passed
  to it, are put back to their states at the forward's start for the
  recompute, and left where the recompute found them
  (:class:`.GeneratorStates`), and so are the modules' ``train()``/``eval()``
  modes (:class:`.TrainingModes`);
- it is DDP-safe: non-reentrant checkpointing runs the recompute inside the
  autograd graph of the outer backward, so DDP's gradient hooks fire once
  per parameter as usual.
"""
import functools
import inspect
from contextlib import contextmanager, nullcontext
from typing import Callable, List, NoReturn, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.torch_version import TorchVersion
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from mmdtr.core.torch_compat import create_selective_checkpoint_contexts
from mmdtr.errors import MmdtrError
from .checkpoint_calls import (CallerContainersFirst, call_with_kwargs,
                               frozen_output)
from .checkpoint_placement import ORIG_FORWARD, refuse_unreachable
from .kept_outputs import KeptOutputs, written_kept_output
from .module_selection import called_modules, resolve_modules
from .module_state_record import state_record
from .recompute_decisions import DecisionLog
from .recompute_guards import (RecomputeContext, RunningStatsGuard,
                               tracking_norms, watch_versions, written_since)
from .recompute_put_back import GeneratorStates, TrainingModes
from .selective_policy import normalize_policy, save_policy

_POLICY_ATTR = '_mmdtr_ckpt_policy'
_NAME_ATTR = '_mmdtr_ckpt_name'


def _described(module: nn.Module) -> str:
    """``"ReLU 'backbone.relu'"``: the class and the name it was selected
    by, for messages (a class name alone did not say which of a glob's
    modules; found by an adversarial search)."""
    name = getattr(module, _NAME_ATTR, None)
    kind = type(module).__name__
    return kind if name is None else f'{kind} {name!r}'


def _kept_output_written(owner: str, op: str, where: str) -> MmdtrError:
    return MmdtrError(
        f'activation_checkpointing: the output of {op} in a checkpointed '
        f'{owner}, which the selective policy keeps, is written in place '
        f'{where} (e.g. by ReLU(inplace=True), or attention scores scaled '
        'in place); the recomputation would read the written value '
        '(PyTorch refuses it, but not through an alias such as a batched '
        "matmul's _unsafe_view).",
        hint='make that write out of place (inplace=False), keep other ops '
        '(a policy without this one), or use policy=None (recompute every '
        'op).')


class _CheckedRecompute:
    """SAC's recompute context, entered only if no kept output of the
    forward was written since (by an op after the checkpointed module
    returned: the forward's own check saw the module's ops)."""

    def __init__(self, kept: KeptOutputs, recompute_context, owner: str):
        self.kept = kept
        self.recompute_context = recompute_context
        self.owner = owner

    def __enter__(self):
        op = self.kept.written()
        if op is not None:
            raise _kept_output_written(self.owner, op,
                                       'after the module returned')
        self.kept.release_outputs()
        return self.recompute_context.__enter__()

    def __exit__(self, exc_type, exc, tb):
        suppressed = self.recompute_context.__exit__(exc_type, exc, tb)
        if isinstance(exc, RuntimeError) and \
                'not found in storage' in str(exc):
            # PyTorch's SAC meets a cast its forward took from autocast's
            # cache (a module called twice, a weight cast before it): its
            # message names neither (found by an adversarial search)
            raise MmdtrError(
                f'activation_checkpointing: the recompute of a checkpointed '
                f'{self.owner} under a selective policy ran an op its '
                f'forward did not ({str(exc).split(" encountered")[0]}); '
                "under autocast, PyTorch's selective checkpointing fails so "
                'when the forward took a cast from autocast\'s cache (a '
                'module called twice, or a weight cast before it).',
                hint='give that module policy=None, or use '
                'torch.autocast(..., cache_enabled=False).') from exc
        return suppressed


@contextmanager
def _recorded_forward(sac_context, decisions: DecisionLog):
    """The forward's context: SAC's (or none), recording the choices made
    inside (:mod:`.recompute_decisions`); entered once, by checkpoint."""
    with decisions.recording(), sac_context:
        yield


def _context_fn(norms: list, generators: GeneratorStates, modes: TrainingModes,
                policy: Optional[Tuple[str, ...]], forward_contexts: list,
                owner: str, inputs: list, params,
                generation: list) -> Tuple[object, object]:
    if policy:
        sac_forward, recompute = create_selective_checkpoint_contexts(
            save_policy(policy))
        kept = KeptOutputs(sac_forward)
        forward_contexts.append(kept)
        recompute = _CheckedRecompute(kept, recompute, owner)
        fwd = kept.forward()
    else:
        fwd, recompute = nullcontext(), nullcontext()
    decisions = DecisionLog()
    return _recorded_forward(fwd, decisions), RecomputeContext(
        RunningStatsGuard(norms), generators, modes, decisions, recompute,
        inputs, params, generation, owner)


def inner_forward(module: nn.Module, compiling: bool = False) -> Callable:
    """The forward a checkpoint of ``module`` runs, or, unwrapped, the
    one of its class (not one set on the instance).

    ``compiling``: inside a torch.compile trace, the class's forward is
    bound by a partial, not ``forward.__get__`` (dynamo 2.5 and 2.6 failed
    tracing the descriptor call at the first call) nor ``MethodType`` (a
    graph break per module from 2.8 on)."""
    own = module.__dict__.get(ORIG_FORWARD)
    if own is not None:
        return own
    if compiling:
        return functools.partial(type(module).forward, module)
    return type(module).forward.__get__(module)


#: Whether a compiled checkpoint updates running statistics once: its
#: compiled recompute updated them a second time on 2.4.1, 2.5.1, 2.6.0,
#: 2.7.1 and 2.8.0; once on 2.9.1, 2.10.0, 2.11.0, 2.13 and 2.14.1
#: (2026-11-27)
_COMPILED_STATS_ONCE = TorchVersion(torch.__version__) >= (2, 9)


# raised outside dynamo's trace: dynamo 2.11 fails on a user exception raised
# in traced code (an internal AssertionError instead); 2.4 and 2.13 pass it.
@torch.compiler.disable
def _refuse_compiled_norms(owner: str) -> NoReturn:
    raise MmdtrError(
        f'activation_checkpointing: {owner} is checkpointed under '
        f'torch.compile and holds a BatchNorm in training mode; before '
        f'PyTorch 2.9 (this is {torch.__version__}) the compiled recompute '
        'can update its running statistics a second time (seen on 2.4 to '
        '2.8).',
        hint='do not compile the checkpointed model, leave that module out '
        'of activation_checkpointing, or use PyTorch 2.9 or newer (checked '
        'there).')


def _compiled_checkpoint(run: Callable, policy: Optional[Tuple[str, ...]],
                         *inputs):
    """Checkpoint under torch.compile: no running-stats guard is needed
    (the compiled graph updates buffers once, outside the recompute) and
    only SAC's own contexts are accepted."""
    if not policy:
        return checkpoint(run, *inputs, use_reentrant=False)
    return checkpoint(
        run,
        *inputs,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts,
                                     save_policy(policy)))


# newer torch takes early_stop per call; older only through the
# process-wide set_checkpoint_early_stop
if 'early_stop' in inspect.signature(checkpoint).parameters:
    _EARLY_STOP_OFF, _NO_EARLY_STOP = {'early_stop': False}, nullcontext
else:  # pragma: no cover - older torch
    _EARLY_STOP_OFF = {}
    _NO_EARLY_STOP = functools.partial(set_checkpoint_early_stop, False)


def checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The forward installed on checkpointed modules (bound per module).

    The leaves of the arguments (keyword ones and those inside lists and
    dicts too) are passed to :func:`checkpoint` positionally, so they cannot
    clash with checkpoint's own options and their tensors count for
    RNG-state preservation; a module whose parameters are not made yet (a
    lazy one) runs its call without checkpoint.
    """
    compiling = torch.compiler.is_compiling()
    inner = inner_forward(self, compiling)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    policy = getattr(self, _POLICY_ATTR, None)
    if compiling:
        if not _COMPILED_STATS_ONCE and tracking_norms(self):
            _refuse_compiled_norms(_described(self))
        run = functools.partial(call_with_kwargs, inner, len(args),
                                tuple(kwargs))
        return _compiled_checkpoint(run, policy, *args, *kwargs.values())
    norms, owner = tracking_norms(self), _described(self)
    forward_contexts = []
    # tensors inside lists, tuples and dicts too (a neck's feature list)
    leaves, spec = tree_flatten((args, kwargs))
    inputs = watch_versions(leaves)
    # what the recompute reads, as the forward leaves it (filled after it)
    watched_inputs, params, generation = [], state_record(self), [0, None]
    if not params.note_forward(self, norms):
        # a lazy module's parameters are made (from the global RNG) by its
        # first call: run as it is, or the recompute's RNG would be put
        # back to before that draw (found by a review)
        out = inner(*args, **kwargs)
        params.lazy_left = params.update(self, norms)
        return out
    if params.reads_statistics:  # an eval-mode norm's: see RecomputeContext
        generation[1] = params.switches
    context_fn = functools.partial(_context_fn, norms,
                                   GeneratorStates(self, leaves),
                                   TrainingModes(self), policy,
                                   forward_contexts, owner, watched_inputs,
                                   params, generation)
    # no early stop: an op that writes a tensor it saved (rrelu's noise) is
    # cut off by it in the recompute, leaving that tensor unwritten. Said
    # per call where torch takes it: the switch is process-wide
    with _NO_EARLY_STOP():
        out = checkpoint(
            CallerContainersFirst(inner, args, kwargs, spec),
            *leaves,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=context_fn,
            **_EARLY_STOP_OFF)
    if frozen_output(out):
        return out  # no backward reaches it, no recompute: as it is
    if written_since(inputs) is not None:
        # the recompute would run on the written input: autograd's in-place
        # error in backward, or, if it passes, other values
        raise MmdtrError(
            f'activation_checkpointing: a checkpointed {owner}'
            ' writes its input in place (e.g. ReLU(inplace=True)); its '
            'recomputation in backward would read the written values.',
            hint='select the block that contains it instead (a glob such '
            "as 'backbone.layer1.*', not 'backbone.layer1.*.*'), or make it "
            'out of place.')
    kept = written_kept_output(forward_contexts)
    if kept is not None:
        raise _kept_output_written(
            owner, kept, 'later in its forward, where a copy made before '
            'the write would not be exact (a kept view, another kept '
            'output over its storage, a copy with other strides, or a '
            'dispatch mode in between)')
    for kept_outputs in forward_contexts:
        kept_outputs.watch_outputs(out)
    # parameters as the forward left them (Embedding(max_norm=...) writes
    # its weight in the forward, and again, to the same values, in the
    # recompute); a write after this is refused at the recompute
    watched_inputs += inputs
    written = params.written_buffer()  # by the forward itself
    if params.update(self, norms) < params.lazy_at_forward:
        raise MmdtrError(
            f'activation_checkpointing: a checkpointed {owner} made a lazy '
            'parameter in this call (its first call left it unmade); its '
            'recomputation would draw other random numbers.',
            hint='run one forward before applying activation checkpointing, '
            'or leave that module unchecked.')
    generation[0] = params.generation
    if written is not None:
        raise MmdtrError(
            f'activation_checkpointing: a checkpointed {owner}'
            f' updates the buffer {written} in its forward (an EMA, a '
            'counter); its recomputation in backward would read the updated '
            'value and update it a second time.',
            hint='select modules that do not update buffers in their '
            "forward (norm layers' running statistics are handled), or "
            'leave this one out.')
    return out


def is_checkpointed(module: nn.Module) -> bool:
    """Whether mmdtr's activation checkpointing wraps ``module``."""
    forward = module.__dict__.get('forward')
    return getattr(forward, '__func__', None) is checkpointed_forward


def replace_forward(module: nn.Module, forward: Callable) -> None:
    """Install ``forward`` on ``module``, beneath the checkpoint if any.

    Other techniques that replace a module's forward (e.g. the torch.fx
    trace of ``efficient_conv_bn_eval``) use this so that a checkpointed
    module stays checkpointed and runs the new forward inside.

    Args:
        module (nn.Module): The module.
        forward (Callable): Its new forward.
    """
    if is_checkpointed(module):
        setattr(module, ORIG_FORWARD, forward)
    else:
        module.forward = forward


def apply_activation_checkpointing(model: nn.Module,
                                   modules: Union[str, Sequence[str]],
                                   policy: Union[None, str,
                                                 Sequence[str]] = None
                                   ) -> List[str]:
    """Checkpoint the forward of the sub-modules of ``model`` named.

    All names and the policy are validated before any module is changed.
    When both a module and one of its descendants are selected, only the
    outer one is wrapped; a container (``nn.ModuleList``, ``nn.ModuleDict``,
    a module without a forward) stands for its members. Applying again to
    a wrapped module updates its policy. mmdtr's ``efficient_conv_bn_eval``
    may come before or after.

    Args:
        model (nn.Module): The model (unwrap DDP first: pass ``.module``).
        modules (str | Sequence[str]): Sub-module names or glob patterns on
            ``model.named_modules()``, e.g. ``'backbone.layer*'``.
        policy (None | str | Sequence[str]): Selective policy, see
            :func:`normalize_policy`. ``None`` recomputes everything.

    Returns:
        list[str]: Names of the modules wrapped, in model order.

    Raises:
        MmdtrError: On an unknown name, pattern, policy or op, or when a
            selected module sits inside a module whose forward was replaced
            by a torch.fx trace (its own forward would never be called),
            or the modules selected hold no module with a forward (only
            containers of parameters or buffers).

    Examples:
        >>> apply_activation_checkpointing(model, 'backbone.layer*')
        ['backbone.layer1', 'backbone.layer2', ...]
        >>> apply_activation_checkpointing(
        ...     model, ['backbone.layer3'], policy='save_compute_heavy')
        ['backbone.layer3']
    """
    ops = normalize_policy(policy)
    found = resolve_modules(model, modules, key='activation_checkpointing')
    names = called_modules(model, list(found), 'activation_checkpointing')
    refuse_unreachable(model, names)
    for name in names:
        module = model.get_submodule(name)
        if not is_checkpointed(module):
            if 'forward' in module.__dict__:
                setattr(module, ORIG_FORWARD, module.__dict__['forward'])
            module.forward = checkpointed_forward.__get__(module)
        setattr(module, _POLICY_ATTR, ops)
        setattr(module, _NAME_ATTR, name)
    if ops:
        save_policy(ops)  # resolve now, outside any torch.compile trace
    return names
