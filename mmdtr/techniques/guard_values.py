"""How a guard of a Conv-BN trace tells a value it read still holds.

A value is kept as a snapshot: immutable scalars (``None``, numbers,
strings, dtypes, devices, enums) as they are, compared by type and value;
tensors, modules, classes, functions, typing constructs and loggers as
themselves, compared by identity (rebinding is seen, a change inside is
not: a value read through a module or a class, ``settings.SCALE``, is not
guarded); lists, tuples, dicts and sets of these, four levels deep, rebuilt
and compared item by item (so ``1`` is not ``True`` inside a dict either).
Any other object cannot be checked, and the module is left unfused
(:class:`TraceRefused`).
"""
import enum
import types

import torch

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype,
              torch.device, enum.Enum, range, slice)
_BY_IDENTITY = (torch.Tensor, types.ModuleType, type, types.FunctionType,
                types.BuiltinFunctionType, types.MethodType)
_IDENTITY_MODULES = ('typing', 'logging')  # Optional, List[int]; a logger
_SEQUENCES = (list, tuple)
_SETS = (set, frozenset)
_DEPTH = 4


class TraceRefused(Exception):
    """The module's forward cannot be replaced by a trace; the message says
    why."""


class _Absent:
    """A value the trace looked for and did not find; one object, also in
    deep copies (an EMA model's guards compare with it)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return 'ABSENT'


ABSENT = _Absent()


class _Unchecked(Exception):
    """A value a snapshot cannot hold."""


def _by_identity(value) -> bool:
    return isinstance(value, _BY_IDENTITY) or \
        type(value).__module__ in _IDENTITY_MODULES


def _snapshot(value, depth=0):
    """A copy of ``value`` that later changes to it do not reach."""
    if isinstance(value, _IMMUTABLE) or _by_identity(value):
        return value
    if depth < _DEPTH:
        if isinstance(value, _SEQUENCES):
            return type(value)(_snapshot(v, depth + 1) for v in value)
        if isinstance(value, _SETS) and all(
                isinstance(v, _IMMUTABLE) for v in value):
            return type(value)(value)
        if isinstance(value, dict) and all(
                isinstance(k, _IMMUTABLE) for k in value):
            return type(value)(
                (k, _snapshot(v, depth + 1)) for k, v in value.items())
    raise _Unchecked


def _same(now, kept) -> bool:
    if _by_identity(kept):
        return now is kept
    if type(now) is not type(kept):
        return False
    if isinstance(kept, _SEQUENCES):
        return len(now) == len(kept) and all(map(_same, now, kept))
    if isinstance(kept, dict):
        return now.keys() == kept.keys() and all(
            _same(now[k], v) for k, v in kept.items())
    return bool(now == kept)  # an immutable scalar, or a set of them


def how_to_check(value, what: str):
    """Return the snapshot a guard keeps of ``value`` (see the module).

    Args:
        value: The value the trace read (:data:`ABSENT` if not found).
        what (str): Names it in the refusal's message.

    Raises:
        TraceRefused: If ``value`` cannot be checked later.
    """
    if value is ABSENT:
        return value
    try:
        return _snapshot(value)
    except _Unchecked:
        raise TraceRefused(
            f'its code reads {what}, a {type(value).__name__}, whose later '
            'changes a trace would not see') from None


def same_value(now, kept) -> bool:
    """Whether ``now`` is still the value ``kept`` (a snapshot from
    :func:`how_to_check`); not if comparing them raises (a tensor put into
    a dict of settings: found by a review).

    Args:
        now: The value read now (:data:`ABSENT` if gone).
        kept: The snapshot.
    """
    if kept is ABSENT or now is ABSENT:
        return now is kept
    try:
        return _same(now, kept)
    except Exception:
        return False
