"""How a guard of a Conv-BN trace tells a value it read still holds.

A value is kept as a snapshot: immutable scalars (``None``, numbers,
strings, dtypes, devices, enums) as they are, compared by type and value
(``-0.0`` is not ``0.0``; a NaN is itself); tensors, modules, classes,
functions, builtins and methods of modules and classes, typing constructs
and loggers as themselves, compared by identity (rebinding is seen, a
change inside is not: a value read through a module or a class,
``settings.SCALE``, is not guarded); lists, tuples, dicts (and their
subclasses: namedtuples, ``torch.Size``, ``OrderedDict``, mmengine's
``ConfigDict``) and sets of these, four levels deep, kept as their type and
items and compared item by item, in order, with their types (``1`` is not
``True``, nor ``1.0``). Any other object (a method bound to an object,
whose state it reads) cannot be checked, and the module is left unfused
(:class:`TraceRefused`).
"""
import enum
import types

import torch

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype,
              torch.device, enum.Enum, range, slice)
_BY_IDENTITY = (torch.Tensor, types.ModuleType, type, types.FunctionType)
_IDENTITY_MODULES = ('typing', 'logging')  # Optional, List[int]; a logger
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


class _Kept:
    """A snapshot of a container: its type and its items (a sequence's,
    in order; a mapping's ``(key, value)`` pairs, in order; a set's
    typed keys)."""
    __slots__ = ('kind', 'items')

    def __init__(self, kind: type, items):
        self.kind, self.items = kind, items


def _key(value):
    """A hashable, typed, bit-exact key of a scalar or a tuple of them (a
    set's member, a mapping's key): ``1``, ``True``, ``1.0``, ``0.0`` and
    ``-0.0`` differ."""
    if isinstance(value, float):
        return float, value.hex()
    if isinstance(value, complex):
        return complex, value.real.hex(), value.imag.hex()
    if isinstance(value, tuple):
        return (type(value), ) + tuple(_key(v) for v in value)
    if isinstance(value, _IMMUTABLE):
        return type(value), value
    raise _Unchecked


def _snapshot(value, depth=0):
    """What a guard keeps of ``value``: later changes to it do not reach
    it. Subclasses (a namedtuple, ``torch.Size``, ``OrderedDict``,
    mmengine's ``ConfigDict``) are kept as their type and items."""
    if isinstance(value, _IMMUTABLE) or _by_identity(value):
        return value
    if depth >= _DEPTH:
        raise _Unchecked
    if isinstance(value, (list, tuple)):
        return _Kept(type(value), [_snapshot(v, depth + 1) for v in value])
    if isinstance(value, dict):
        return _Kept(
            type(value),
            [(_key(k), _snapshot(v, depth + 1)) for k, v in value.items()])
    if isinstance(value, (set, frozenset)):
        return _Kept(type(value), frozenset(_key(v) for v in value))
    raise _Unchecked


def _same(now, kept) -> bool:
    if isinstance(kept, _Kept):
        if type(now) is not kept.kind:
            return False
        if isinstance(now, (list, tuple)):
            return len(now) == len(kept.items) and all(
                map(_same, now, kept.items))
        if isinstance(now, dict):
            return len(now) == len(kept.items) and all(
                _key(k) == key and _same(v, item)
                for (k, v), (key, item) in zip(now.items(), kept.items))
        return frozenset(_key(v) for v in now) == kept.items
    if _by_identity(kept):
        return now is kept
    return type(now) is type(kept) and _key(now) == _key(kept)


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
