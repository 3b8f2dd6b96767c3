"""A torch.fx trace of one module's forward, used only while it still holds.

A trace runs the module's own Python once, with proxies for its arguments,
and keeps the ops: whatever the code read of the module's plain attributes
(``self.active`` of a supernet's choice block, ``self.norm1_name``) is baked
in, an argument left at its default (``identity=None``) was taken for a
tensor, and attribute writes (``self.feat = ...``) are lost. This module
records what the trace read and wrote, refuses a forward that writes, and
installs a forward that runs the trace only while every attribute read
still holds the value the trace saw and every parameter is passed an
argument other than ``None``, and the module's own forward otherwise.

Not seen: module-level globals the code reads, and ``isinstance`` checks of
an argument (a proxy is not a tensor).
"""
import copy
import enum
import inspect
import itertools
import re
import types
from typing import Callable, Dict, List, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

#: Attributes every module has: its parameters, buffers, children and
#: hooks live in them, and ``training`` is traced in both modes instead.
_MODULE_OWN = frozenset(vars(nn.Module())) | {'forward'}

#: What torch.fx itself sets on the traced module: its constants
#: (``_tensor_constant0``, ``_tree_spec_constant0``, ``_Foo_constant_0``).
_FX_CONSTANT = re.compile(r'_\w+_constant_?\d+$')

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype,
              torch.device, enum.Enum, range, slice)
_CONTAINERS = (list, tuple, dict, set, frozenset)
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)


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
    """An attribute the trace looked for and did not find; one object, also
    in deep copies (an EMA model's guards compare with it)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return '_ABSENT'


_ABSENT = _Absent()


class _Guard:
    """One attribute the trace read (of the module or a sub-module), and
    how to tell it still holds: equality with a copy (plain data), identity
    (tensors, functions), still absent (``getattr(self, 'x', default)``)."""
    __slots__ = ('owner', 'name', 'value', 'by_identity')

    def __init__(self, owner: nn.Module, name: str, value):
        if value is _ABSENT:
            self.value, self.by_identity = value, True
        elif _plain_data(value):
            self.value, self.by_identity = copy.deepcopy(value), False
        elif isinstance(value, (torch.Tensor, ) + _CALLABLES):
            self.value, self.by_identity = value, True
        else:
            raise TraceRefused(
                f'its own forward reads {type(owner).__name__}.{name}, a '
                f'{type(value).__name__}, whose later changes a trace '
                'would not see')
        self.owner, self.name = owner, name

    def holds(self) -> bool:
        owner = self.owner
        now = owner.__dict__.get(self.name, _ABSENT)
        if self.value is _ABSENT:
            return now is _ABSENT and not any(
                self.name in owner.__dict__[d]
                for d in ('_parameters', '_buffers', '_modules'))
        if self.by_identity:
            return now is self.value
        return now is not _ABSENT and type(now) is type(self.value) and \
            now == self.value


def _is_watched(name: str) -> bool:
    return name not in _MODULE_OWN and not name.startswith('__')


def watched_trace(module: nn.Module, trace: Callable[[], fx.Graph]
                  ) -> Tuple[fx.Graph, Dict[tuple, object]]:
    """Run ``trace()`` while recording the plain attributes of ``module``
    and its sub-modules its code reads (a child's flag too), and those it
    looked for and did not find; refuse a write to an attribute of
    ``module``.

    Returns:
        tuple: The graph, and ``{(owner, name): value}`` of the attributes
        read (``_ABSENT`` for those not found).

    Raises:
        TraceRefused: If the forward writes an attribute of the module.
    """
    reads, writes = {}, []
    classes = {m: type(m) for m in module.modules()}

    def read(self, name):  # through the class's own (a child may have one)
        value = classes[self].__getattribute__(self, name)
        if _is_watched(name) and \
                name in object.__getattribute__(self, '__dict__'):
            reads.setdefault((self, name), value)
        return value

    def missing(self, name):
        try:  # parameters, buffers and sub-modules are found here
            return classes[self].__getattr__(self, name)
        except AttributeError:
            if _is_watched(name):
                reads.setdefault((self, name), _ABSENT)
            raise

    def write(self, name, value):
        if self is not module or _FX_CONSTANT.match(name):
            classes[self].__setattr__(self, name, value)  # fx's constants
        else:  # not made: the module keeps its state, and is refused
            writes.append(name)

    swapped = []
    try:
        for m, cls in classes.items():
            m.__class__ = type(
                cls.__name__, (cls, ), {
                    '__getattribute__': read,
                    '__getattr__': missing,
                    '__setattr__': write,
                    '__module__': cls.__module__
                })
            swapped.append(m)
    except TypeError as exc:  # __slots__ and the like
        for m in swapped:
            object.__setattr__(m, '__class__', classes[m])
        raise TraceRefused(f'its class cannot be watched ({exc})') from None
    try:
        graph = trace()
    except Exception:
        if not writes:
            raise
    finally:
        for m in swapped:
            object.__setattr__(m, '__class__', classes[m])
    if writes:  # the trace may have failed on the write it did not make
        raise TraceRefused(
            f'its own forward sets self.{writes[0]}, which a trace would '
            'not do')
    return graph, reads


class GuardedForward:
    """A forward for ``module`` that calls ``traced`` while the attributes
    ``reads`` (from :func:`watched_trace`) hold and every parameter of the
    module's forward is passed an argument other than ``None``, and
    ``fallback`` otherwise.

    An object, not a closure: a deep copy of the module (``copy.deepcopy``,
    EMA models) copies it along and runs the copy's trace and forward.

    Args:
        module (nn.Module): The module.
        traced (Callable): The trace's forward (a ``GraphModule``'s).
        fallback (Callable): The module's own forward.
        reads (dict): The attributes the trace read.

    Raises:
        TraceRefused: If an attribute read cannot be checked later.
    """

    def __init__(self, module: nn.Module, traced: Callable, fallback: Callable,
                 reads: Dict[str, object]):
        self.module, self.traced, self.fallback = module, traced, fallback
        self.guards = [
            _Guard(owner, name, value)
            for (owner, name), value in reads.items()
        ]
        # the sub-modules the trace calls: one replaced (an activation, a
        # downsample set to None) would not run in the trace (a review)
        self.children = list(module.named_modules())
        params = list(
            inspect.signature(type(module).forward).parameters.values())[1:]
        self.fixed = [
            p.name for p in params
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.traced.__self__

    def __call__(self, *args, **kwargs):
        if all(g.holds() for g in self.guards) and \
                _all_passed(self.fixed, args, kwargs) and \
                _same_modules(self.children, self.module):
            return self.traced(*args, **kwargs)
        return self.fallback(*args, **kwargs)


def _same_modules(children: list, module: nn.Module) -> bool:
    """Whether ``module``'s sub-modules are still ``children``."""
    end = (None, None)
    for (name, child), (name_now, child_now) in itertools.zip_longest(
            children, module.named_modules(), fillvalue=end):
        if name != name_now or child is not child_now:
            return False
    return True


def _all_passed(fixed: List[str], args: tuple, kwargs: dict) -> bool:
    """Whether each named parameter got an argument, none of them ``None``:
    the trace took each for a value (a proxy), so a default or a ``None``
    would meet a branch the trace fixed (``if identity is None``)."""
    if len(args) + len(kwargs) < len(fixed) or not all(
            name in kwargs for name in fixed[len(args):]):
        return False
    return all(a is not None for a in args) and all(v is not None
                                                    for v in kwargs.values())
