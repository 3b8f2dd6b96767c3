"""How a guard of a Conv-BN trace tells a value it read still holds.

Plain data (immutable scalars and containers of them) is compared by value
with a deep copy; tensors, modules, classes, functions, typing constructs
and loggers by identity (rebinding is seen, a change inside is not: a value
read through a module or a class, ``settings.SCALE``, is not guarded); any
other object cannot be checked, and the module is left unfused
(:class:`TraceRefused`).
"""
import copy
import enum
import types

import torch

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype,
              torch.device, enum.Enum, range, slice)
_CONTAINERS = (list, tuple, dict, set, frozenset)
CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_BY_IDENTITY = (torch.Tensor, types.ModuleType, type) + CALLABLES


class TraceRefused(Exception):
    """The module's forward cannot be replaced by a trace; the message says
    why."""


def _plain_data(value, depth=0) -> bool:
    """Whether ``value`` is made of immutable scalars and containers only,
    so that a deep copy compares equal exactly while it is unchanged."""
    if isinstance(value, _IMMUTABLE):
        return True
    if depth < 4 and isinstance(value, _CONTAINERS):
        items = value.items() if isinstance(value, dict) else \
            ((v, None) for v in value)
        return all(
            _plain_data(k, depth + 1) and _plain_data(v, depth + 1)
            for k, v in items)
    return False


class _Absent:
    """A value the trace looked for and did not find; one object, also in
    deep copies (an EMA model's guards compare with it)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return 'ABSENT'


ABSENT = _Absent()


def how_to_check(value, what: str) -> tuple:
    """``(value kept, whether by identity)`` for a guard on ``value``.

    Raises:
        TraceRefused: If ``value`` cannot be checked later; ``what`` names
            it in the message.
    """
    if value is ABSENT:
        return value, True
    if _plain_data(value):
        return copy.deepcopy(value), False
    if isinstance(value, _BY_IDENTITY) or type(value).__module__ in (
            'typing', 'logging'):  # Optional, List[int]; a module's logger
        return value, True
    raise TraceRefused(
        f'its code reads {what}, a {type(value).__name__}, whose later '
        'changes a trace would not see')


def same_value(now, value, by_identity: bool) -> bool:
    """Whether ``now`` is still ``value`` (kept by :func:`how_to_check`);
    not if comparing them raises (a tensor put into a dict of settings:
    found by a review)."""
    if by_identity:
        return now is value
    if now is ABSENT or type(now) is not type(value):
        return False
    try:
        return bool(now == value)
    except Exception:
        return False
