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
The module-level globals its code names are guarded the same way, and a
forward that checks the type of an argument or of a value made from one
(``isinstance(x, torch.Tensor)``: a proxy is not a tensor, so the trace
would fix the branch) is refused.

Not seen: ``type(x)`` of a proxy, and globals read by functions the code
reaches other than through its own name, its classes' methods and the
module-level functions it names.
"""
import copy
import enum
import inspect
import itertools
import os
import re
import sys
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
#: Checked by identity: rebinding is seen, a change inside is not (as for a
#: function read from an attribute).
_BY_IDENTITY = (torch.Tensor, types.ModuleType, type) + _CALLABLES
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


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
        self.value, self.by_identity = _how_to_check(
            value, f'{type(owner).__name__}.{name}')
        self.owner, self.name = owner, name

    def holds(self) -> bool:
        owner = self.owner
        now = owner.__dict__.get(self.name, _ABSENT)
        if self.value is _ABSENT:
            return now is _ABSENT and not any(
                self.name in owner.__dict__[d]
                for d in ('_parameters', '_buffers', '_modules'))
        return _same(now, self.value, self.by_identity)


def _how_to_check(value, what: str) -> tuple:
    """``(value kept, whether by identity)`` for a guard on ``value``."""
    if value is _ABSENT:
        return value, True
    if _plain_data(value):
        return copy.deepcopy(value), False
    if isinstance(value, _BY_IDENTITY):
        return value, True
    raise TraceRefused(
        f'its own forward reads {what}, a {type(value).__name__}, whose '
        'later changes a trace would not see')


def _same(now, value, by_identity: bool) -> bool:
    if by_identity:
        return now is value
    return now is not _ABSENT and type(now) is type(value) and now == value


class _GlobalGuard:
    """A module-level global the code names; copies of a module share it
    (a deep copy of the module does not copy its code's globals)."""
    __slots__ = ('namespace', 'name', 'value', 'by_identity')

    def __init__(self, namespace: dict, name: str, value):
        self.value, self.by_identity = _how_to_check(
            value, f"the global {namespace.get('__name__')}.{name}")
        self.namespace, self.name = namespace, name

    def holds(self) -> bool:
        return _same(
            self.namespace.get(self.name, _ABSENT), self.value,
            self.by_identity)

    def __deepcopy__(self, memo):
        return self


def _in_torch(code: types.CodeType) -> bool:
    return code.co_filename.startswith(_TORCH_DIR)


def _functions_run(module: nn.Module) -> list:
    """The functions a trace of ``module`` may run outside torch: its
    class's forward, the methods (and properties) of its and its
    sub-modules' classes it names, the module-level functions it names,
    and so on from each of those."""
    classes = [
        klass for m in module.modules() for klass in type(m).__mro__
        if not _in_torch_module(klass)
    ]
    found, todo = [], [type(module).forward]
    while todo:
        function = todo.pop()
        if function in found or _in_torch(function.__code__):
            continue
        found.append(function)
        for name in _names(function.__code__):
            candidates = [function.__globals__.get(name)]
            candidates += [vars(klass).get(name) for klass in classes]
            for c in candidates:
                c = c.fget if isinstance(c, property) else getattr(
                    c, '__func__', c)  # static and class methods
                if isinstance(c, types.FunctionType):
                    todo.append(c)
    return found


def _in_torch_module(klass: type) -> bool:
    return klass.__module__.split('.')[0] in ('torch', 'builtins')


def _names(code: types.CodeType):
    """The names ``code`` and the code nested in it (closures,
    comprehensions) load: globals, attributes and methods."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def guard_globals(module: nn.Module) -> List[_GlobalGuard]:
    """Guards on the module-level globals the code a trace of ``module``
    runs names (:func:`_functions_run`); a name that is also an attribute
    (``x.shape`` where a global ``shape`` exists) is guarded too.

    Raises:
        TraceRefused: If one cannot be checked later.
    """
    guards = {}
    for function in _functions_run(module):
        namespace = function.__globals__
        for name in _names(function.__code__):
            key = (id(namespace), name)
            if name in namespace and key not in guards:
                guards[key] = _GlobalGuard(namespace, name, namespace[name])
    return list(guards.values())


class TypeWatchingTracer(fx.Tracer):
    """An ``fx.Tracer`` whose proxies see an ``isinstance`` check by code
    outside torch (the module's own): ``type_checks`` lists where.

    ``isinstance(proxy, C)`` reads ``proxy.__class__`` when the proxy's
    type is not ``C``; torch's own checks (fx creating nodes) are not
    counted, a ``Parameter`` check is counted for its caller.
    """

    def trace(self, root, concrete_args=None):
        self.type_checks = []
        return super().trace(root, concrete_args)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _TypeWatchedProxy(node, self)


class _TypeWatchedProxy(fx.Proxy):

    @property
    def __class__(self):
        caller = sys._getframe(1)
        if caller.f_code.co_name == '__instancecheck__' and _in_torch(
                caller.f_code):
            caller = caller.f_back  # a Parameter's metaclass
        if caller is not None and not _in_torch(caller.f_code):
            self.tracer.type_checks.append(
                f'{caller.f_code.co_name} (line {caller.f_lineno})')
        return _TypeWatchedProxy


def _is_watched(name: str) -> bool:
    return name not in _MODULE_OWN and not name.startswith('__')


def watched_trace(module: nn.Module, tracer: TypeWatchingTracer
                  ) -> Tuple[fx.Graph, Dict[tuple, object]]:
    """Trace ``module`` with ``tracer`` while recording the plain
    attributes of ``module`` and its sub-modules its code reads (a child's
    flag too), and those it looked for and did not find; refuse a write to
    an attribute of ``module``, and a type check of a proxy.

    Returns:
        tuple: The graph, and ``{(owner, name): value}`` of the attributes
        read (``_ABSENT`` for those not found).

    Raises:
        TraceRefused: If the forward writes an attribute of the module or
            checks the type of a value the trace stands in for.
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
        graph = tracer.trace(module)
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
    if tracer.type_checks:  # else the branch taken is fixed
        raise TraceRefused(
            'its own code checks the type of an argument or of a value '
            f'made from one (isinstance, in {tracer.type_checks[0]}), '
            'whose branch a trace would fix')
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
        ] + guard_globals(module)
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
