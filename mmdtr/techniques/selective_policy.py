"""Selective checkpointing policies: which ops' outputs are kept (torch only).

A policy is ``None`` (recompute every op), a name of :data:`POLICIES`, or a
list of aten op names. :func:`normalize_policy` validates it when the config
is read; :func:`save_policy` builds the policy function given to
:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`. The
writes to the outputs kept are watched by :mod:`.kept_outputs`.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from mmdtr.core.op_semantics import op_info
from mmdtr.core.torch_compat import (CheckpointPolicy,
                                     create_selective_checkpoint_contexts)
from mmdtr.errors import MmdtrError
from .module_selection import closest_names

#: Named selective policies: the aten ops whose outputs are kept.
POLICIES: Dict[str, Tuple[str, ...]] = {
    'save_compute_heavy': ('mm', 'addmm', 'bmm', 'baddbmm', 'convolution',
                           '_scaled_dot_product_flash_attention',
                           '_scaled_dot_product_flash_attention_for_cpu',
                           '_scaled_dot_product_efficient_attention',
                           '_scaled_dot_product_cudnn_attention'),
    'save_matmuls': ('mm', 'addmm', 'bmm', 'baddbmm'),
    'save_convolutions': ('convolution', ),
    'recompute_all': (),
}


def _op_name_candidates() -> List[str]:
    try:
        names = torch._C._dispatch_get_all_op_names()
    except AttributeError:  # pragma: no cover - private API moved
        return []
    return sorted({
        name[len('aten::'):].split('.')[0]
        for name in names if name.startswith('aten::')
    })


def _bad_policy(policy, why: str, close: Sequence[str] = ()) -> MmdtrError:
    extra = f' Closest aten ops: {list(close)}.' if close else ''
    return MmdtrError(
        f'activation_checkpointing policy={policy!r} is not accepted: {why}.'
        f'{extra} Accepted: None, one of {sorted(POLICIES)}, or a list of '
        "aten op names such as ['mm', 'aten.convolution', 'aten::bmm'].",
        hint="use policy='save_compute_heavy' to keep matmul/conv outputs.")


def _canonical_op(name: str, policy) -> str:
    """Return ``'aten.<op>'`` or ``'aten.<op>.<overload>'`` for ``name``."""
    text = name.strip()
    for prefix in ('torch.ops.', 'aten::', 'aten.'):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = text.replace('::', '.')
    if text.startswith('aten.'):
        text = text[len('aten.'):]
    parts = text.split('.')
    if not text or len(parts) > 2 or not all(parts):
        raise _bad_policy(policy, f'{name!r} is not an aten op name')
    packet = getattr(torch.ops.aten, parts[0], None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise _bad_policy(policy, f'{name!r} is not an aten op',
                          closest_names(parts[0], _op_name_candidates()))
    if len(parts) == 2 and parts[1] not in packet.overloads():
        raise _bad_policy(
            policy, f'aten.{parts[0]} has no overload {parts[1]!r} '
            f'(overloads: {packet.overloads()})')
    ops = _overloads(packet, parts[1:])
    if all(_not_kept_why(packet, op) for op in ops):
        # the reason of the overload a call takes (found by a review: an
        # out= overload listed first gave _fused_dropout's reason as "in
        # place")
        raise _bad_policy(policy, f'{name!r} {_not_kept_why(packet, ops[0])}')
    return 'aten.' + '.'.join(parts)


#: the arguments that a kept op may write: batch norm's running statistics,
#: updated once, in the forward (the recompute skips a kept op)
_KEPT_WRITES = frozenset(('running_mean', 'running_var'))


def _not_kept_why(packet, op) -> Optional[str]:
    """Why a policy cannot keep ``op``'s output, or ``None`` if it can.

    Never kept: out= and in-place ops (``add_``'s list overload too, whose
    schema does not say it): the output is the written input, which
    selective checkpointing refuses in backward; an op writing another
    argument that backward reads (``rrelu_with_noise``'s noise: the
    recompute skips it, so backward read uninitialised noise); and an op
    drawing random numbers, but for attention with ``dropout_p``, which
    :func:`_keeping`'s policy keeps only when it is 0 (the recompute skips a
    kept op's draw, so the ops after it drew other numbers). Found by an
    adversarial search.
    """
    schema = op._schema
    if (packet.__name__.endswith('_') and schema.is_mutable) or any(
            r.alias_info is not None and r.alias_info.is_write
            for r in schema.returns):
        return ('writes its input in place: the output it would keep is '
                'the written input, which selective checkpointing refuses '
                'in backward')
    info = op_info(op)  # the engine's reading: unmarked writes too
    written = [
        info.arg_names[i] for i in info.written_args + info.side_effect_args
        if info.arg_names[i] not in _KEPT_WRITES
    ]
    if written:
        return (f'writes its argument {written[0]!r}, which the recompute '
                'would skip if the op were kept')
    if torch.Tag.nondeterministic_seeded in op.tags and \
            _dropout_index(op) is None:
        return ('draws random numbers: kept, the recompute would skip its '
                'draw and the random ops after it would draw other numbers')
    return None


def _dropout_index(op) -> Optional[int]:
    """The position of the ``dropout_p`` argument of ``op``, an op drawing
    random numbers only through it (fused attention), or ``None``."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return None
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == 'dropout_p':
            return i
    return None


def _overloads(packet, names: Sequence[str]) -> list:
    """The overloads of ``packet`` named, all if none, ``default`` first."""
    names = names or sorted(packet.overloads(), key=lambda n: n != 'default')
    return [getattr(packet, name) for name in names]


def _kept_overloads(packet, overloads: Sequence[str]) -> list:
    """The overloads of ``packet`` named (all if none) that a policy may
    keep (:func:`_not_kept_why`)."""
    return [
        op for op in _overloads(packet, overloads)
        if _not_kept_why(packet, op) is None
    ]


def normalize_policy(policy: Union[None, str, Sequence[str]]
                     ) -> Optional[Tuple[str, ...]]:
    """Validate a selective policy and return its canonical op names.

    Args:
        policy (None | str | Sequence[str]): ``None`` or ``'recompute_all'``
            (plain checkpointing: recompute every op), a name of
            :data:`POLICIES`, or a list of aten op names (``'mm'``,
            ``'aten.mm'``, ``'aten::mm'``, ``'aten.mm.default'``) whose
            outputs are kept.

    Returns:
        tuple[str] | None: Sorted canonical names (``'aten.mm'``), or
        ``None`` for plain checkpointing.

    Raises:
        MmdtrError: If the policy or an op name is unknown, if an op
            named cannot be kept (:func:`_not_kept_why`: in-place and out=
            ops, ops writing another argument, ops drawing random numbers),
            or if PyTorch is older than 2.5 (no selective checkpointing).
    """
    if policy is None:
        return None
    if isinstance(policy, str):
        if policy not in POLICIES:
            close = closest_names(policy, sorted(POLICIES))
            raise _bad_policy(
                policy, 'unknown policy name' +
                (f' (closest: {close})' if close else ''))
        names = [n for n in POLICIES[policy] if hasattr(torch.ops.aten, n)]
    elif (isinstance(policy, (list, tuple)) and policy
          and all(isinstance(name, str) for name in policy)):
        names = list(policy)
    else:
        raise _bad_policy(policy, 'expected a str or a non-empty list of '
                          'str')
    if not names:
        return None
    canonical = tuple(sorted({_canonical_op(name, policy) for name in names}))
    if create_selective_checkpoint_contexts is None:
        raise MmdtrError(
            f'activation_checkpointing policy={policy!r} is not accepted on '
            f'PyTorch {torch.__version__}: selective checkpointing needs '
            'torch.utils.checkpoint.create_selective_checkpoint_contexts '
            '(PyTorch >= 2.5).',
            hint="use policy=None or 'recompute_all' (recompute every op), "
            'or upgrade PyTorch to 2.5 or newer.')
    return canonical


def _keeping(overloads: Tuple[object, ...]) -> Callable:
    """The SAC policy function: keep the outputs of ``overloads``,
    recompute the rest. A plain function, not an object with
    ``__call__``: dynamo before 2.10 takes only a function as the policy
    under ``torch.compile`` (its own error at the first call otherwise).

    Args:
        overloads (tuple[OpOverload]): The aten op overloads to keep.

    Returns:
        Callable: The policy, with the attributes ``overloads`` and
        ``ops`` (the same, as a frozenset).
    """
    ops = frozenset(overloads)
    # attention ops that draw only with dropout_p > 0 (_not_kept_why)
    dropout_index = {
        op: i
        for op in overloads if (i := _dropout_index(op)) is not None
    }

    def keep_or_recompute(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op not in ops:
            return CheckpointPolicy.PREFER_RECOMPUTE
        i = dropout_index.get(op)
        if i is not None:
            p = kwargs['dropout_p'] if 'dropout_p' in kwargs else (
                args[i] if i < len(args) else 0.0)
            if p != 0:  # it draws: recomputed with the restored RNG state
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    keep_or_recompute.overloads, keep_or_recompute.ops = overloads, ops
    return keep_or_recompute


#: canonical policy names -> their policy function (a plain dict, not an
#: lru_cache, so torch.compile can read it without a warning; built before
#: any trace, so dynamo finds a function made outside it)
_SAVE_POLICIES: Dict[Tuple[str, ...], Callable] = {}


def save_policy(names: Tuple[str, ...]) -> Callable:
    """The SAC policy function that keeps the outputs of ``names``' ops.

    Built once per ``names`` and cached.

    Args:
        names (tuple[str]): Canonical op names from
            :func:`normalize_policy` (``'aten.<op>'`` or
            ``'aten.<op>.<overload>'``); an op without an overload stands
            for every overload of it that a policy may keep.

    Returns:
        Callable: The policy function for
        :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`.
    """
    policy = _SAVE_POLICIES.get(names)
    if policy is None:
        overloads = []
        for name in names:
            parts = name.split('.')[1:]
            overloads += _kept_overloads(
                getattr(torch.ops.aten, parts[0]), parts[1:])
        policy = _SAVE_POLICIES[names] = _keeping(tuple(overloads))
    return policy
