"""How a guard of a Conv-BN trace tells a value it read still holds.

A value is kept as a snapshot: immutable scalars (``None``, numbers,
strings, dtypes, devices, enums) as they are, compared by type and value
(``-0.0`` is not ``0.0``; a NaN is itself); tensors, modules, classes,
functions, builtins and methods of modules and classes, typing constructs
and loggers as themselves, compared by identity (rebinding is seen, a
change inside is not: a value read through a module or a class,
``settings.SCALE``, is not guarded); lists, tuples and dicts of these, four
levels deep, rebuilt and compared item by item, in order, with their types
(``1`` is not ``True``, nor ``1.0``); sets and other containers of scalars
(namedtuples, ``OrderedDict``) copied whole and compared with their own
``==``. Any other object (a method bound to an object, whose state it
reads) cannot be checked, and the module is left unfused
(:class:`TraceRefused`).
"""
import copy
import enum
import types

import torch

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype,
              torch.device, enum.Enum, range, slice)
_BY_IDENTITY = (torch.Tensor, types.ModuleType, type, types.FunctionType)
_IDENTITY_MODULES = ('typing', 'logging')  # Optional, List[int]; a logger
_CONTAINERS = (list, tuple, dict, set, frozenset)
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
    if isinstance(value, _BY_IDENTITY) or \
            type(value).__module__ in _IDENTITY_MODULES:
        return True
    # a builtin or a bound method: only of a module or a class (len,
    # a classmethod), whose state is not data (``cfg.get`` reads ``cfg``)
    owner = getattr(value, '__self__', None)
    return isinstance(
        value, (types.BuiltinFunctionType, types.MethodType)) and (
            owner is None or isinstance(owner, (types.ModuleType, type)))


def _scalars_only(value, depth=0) -> bool:
    if isinstance(value, _IMMUTABLE):
        return True
    if depth < _DEPTH and isinstance(value, _CONTAINERS):
        items = value.items() if isinstance(value, dict) else \
            ((v, None) for v in value)
        return all(
            _scalars_only(k, depth + 1) and _scalars_only(v, depth + 1)
            for k, v in items)
    return False


def _snapshot(value, depth=0):
    """A copy of ``value`` that later changes to it do not reach."""
    if isinstance(value, _IMMUTABLE) or _by_identity(value):
        return value
    kind = type(value)
    if depth < _DEPTH and kind in (list, tuple):
        return kind(_snapshot(v, depth + 1) for v in value)
    if depth < _DEPTH and kind is dict and all(
            isinstance(k, _IMMUTABLE) for k in value):
        return {k: _snapshot(v, depth + 1) for k, v in value.items()}
    if isinstance(value, _CONTAINERS) and _scalars_only(value):
        # a set, a namedtuple, an OrderedDict: copied whole, compared
        # with its own == (an OrderedDict's sees the order)
        return copy.deepcopy(value)
    raise _Unchecked


def _same_scalar(now, kept) -> bool:
    if isinstance(kept, float):  # -0.0 is not 0.0, a NaN is itself
        return now.hex() == kept.hex()
    if isinstance(kept, complex):
        return _same_scalar(now.real, kept.real) and \
            _same_scalar(now.imag, kept.imag)
    return bool(now == kept)


def _same(now, kept) -> bool:
    if _by_identity(kept):
        return now is kept
    kind = type(kept)
    if type(now) is not kind:
        return False
    if kind in (list, tuple):
        return len(now) == len(kept) and all(map(_same, now, kept))
    if kind is dict:  # in order, keys of the same types
        return [(type(k), k) for k in now] == [
            (type(k), k) for k in kept
        ] and all(_same(now[k], v) for k, v in kept.items())
    if isinstance(kept, (set, frozenset)):
        return {(type(v), v) for v in now} == {(type(v), v) for v in kept}
    if isinstance(kept, _CONTAINERS):
        return bool(now == kept)  # a copied subclass: its own ==
    return _same_scalar(now, kept)


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
    except Exception:  # _Unchecked, or a copy that failed
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
