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
The globals and closure cells its code reads are guarded the same way, and
code that checks the type of a proxy is refused (:mod:`.code_guards`).
"""
import inspect
import itertools
import re
from typing import Callable, Dict, List, Tuple

import torch.fx as fx
import torch.nn as nn

from .code_guards import CodeGuard, TypeWatchingTracer, is_library_class
from .guard_values import ABSENT, TraceRefused, how_to_check, same_value
from .recompute_decisions import decide

#: Attributes every module has: its parameters, buffers, children and
#: hooks live in them, and ``training`` is traced in both modes instead.
_MODULE_OWN = frozenset(vars(nn.Module())) | {'forward'}

#: What torch.fx itself sets on the traced module: its constants
#: (``_tensor_constant0``, ``_tree_spec_constant0``, ``_Foo_constant_0``).
_FX_CONSTANT = re.compile(r'_\w+_constant_?\d+$')


class _Guard:
    """One attribute the trace read (of the module or a sub-module), and
    how to tell it still holds: a snapshot (:mod:`.guard_values`), or still
    absent (``getattr(self, 'x', default)``)."""
    __slots__ = ('owner', 'name', 'value')

    def __init__(self, owner: nn.Module, name: str, value):
        where = owner if isinstance(owner, type) else type(owner)
        self.value = how_to_check(value, f'{where.__name__}.{name}')
        self.owner, self.name = owner, name

    def holds(self) -> bool:
        owner = self.owner
        now = owner.__dict__.get(self.name, ABSENT)
        if self.value is ABSENT:
            return now is ABSENT and not any(
                self.name in owner.__dict__[d]
                for d in ('_parameters', '_buffers', '_modules'))
        return same_value(now, self.value)


def _is_watched(name: str) -> bool:
    """Not the module's own machinery, nor a constant torch.fx adds (it
    looks one up before it sets it: guarded as absent, the trace never ran;
    found by a review)."""
    return name not in _MODULE_OWN and not name.startswith('__') and \
        not _FX_CONSTANT.match(name)


def _snapshot_or_none(value):
    try:
        return how_to_check(value, '')
    except TraceRefused:
        return None


def _data_class_attribute(cls: type, name: str):
    """The class (outside torch) whose plain data attribute ``name`` an
    instance of ``cls`` without one of its own reads, or ``None`` (a method,
    a property, torch's own)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            attr = vars(klass)[name]
            return klass if not is_library_class(klass) and not hasattr(
                type(attr), '__get__') else None
    return None


def watched_trace(module: nn.Module, tracer: TypeWatchingTracer
                  ) -> Tuple[fx.Graph, Dict[tuple, object]]:
    """Trace ``module`` with ``tracer`` while recording the plain
    attributes of ``module`` and its sub-modules its code reads (a child's
    flag too), and those it looked for and did not find; refuse a write to
    an attribute of ``module``, and a type check of a proxy.

    Args:
        module (nn.Module): The module to trace.
        tracer (TypeWatchingTracer): Traces it (``tracer.trace(module)``).

    Returns:
        tuple: The graph, and ``{(owner, name): value}`` of the attributes
        read (``ABSENT`` for those not found).

    Raises:
        TraceRefused: If the forward writes an attribute of the module
            (or changes one in place: a list it appends to), or checks the
            type of a value the trace stands in for.
    """
    reads, writes, first = {}, [], {}
    classes = {m: type(m) for m in module.modules()}

    def read(self, name):  # through the class's own (a child may have one)
        value = classes[self].__getattribute__(self, name)
        if not _is_watched(name):
            return value
        if name in object.__getattribute__(self, '__dict__'):
            if (self, name) not in reads:
                reads[self, name] = value
                first[self, name] = _snapshot_or_none(value)
        else:  # a class attribute: guarded on its class (found by a review)
            klass = _data_class_attribute(classes[self], name)
            if klass is not None:
                reads.setdefault((self, name), ABSENT)  # not shadowed
                reads.setdefault((klass, name), vars(klass)[name])
        return value

    def missing(self, name):
        try:  # parameters, buffers and sub-modules are found here
            return classes[self].__getattr__(self, name)
        except AttributeError:
            if _is_watched(name):
                reads.setdefault((self, name), ABSENT)
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
    for (owner, name), kept in first.items():  # a counter in a list
        if kept is not None and not same_value(owner.__dict__.get(name), kept):
            raise TraceRefused(
                f'its own forward changes self.{name} in place, which a '
                'trace would not do')
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
        code_guards (list): Other guards (objects with ``holds()``): those
            on the globals and cells its code reads, from
            :func:`.guard_code` (before the trace: it refuses code that
            writes a global, which the trace would run), and the caller's
            (each fused Conv+BN pair's).

    Raises:
        TraceRefused: If an attribute read cannot be checked later.
    """

    def __init__(self, module: nn.Module, traced: Callable, fallback: Callable,
                 reads: Dict[str, object], code_guards: List[CodeGuard]):
        self.module, self.traced, self.fallback = module, traced, fallback
        self.guards = [
            _Guard(owner, name, value)
            for (owner, name), value in reads.items()
        ] + code_guards
        # the sub-modules the trace calls: one replaced (an activation, a
        # downsample set to None) would not run in the trace (a review)
        self.children = list(module.named_modules())
        self.tensors = _tensor_attributes(module, self.graph_module)
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
        # in a checkpoint's recompute: the path its forward took
        # (:mod:`.recompute_decisions`)
        if decide(lambda: self._holds(args, kwargs)):
            return self.traced(*args, **kwargs)
        return self.fallback(*args, **kwargs)

    def _holds(self, args: tuple, kwargs: dict) -> bool:
        """Whether the trace may run for this call."""
        return all(g.holds() for g in self.guards) and \
            _all_passed(self.fixed, args, kwargs) and \
            _same_modules(self.children, self.module) and \
            _rebind(self.tensors)


def _tensor_attributes(module: nn.Module, gm: fx.GraphModule) -> list:
    """``[owner in module, owner in gm, name]`` of each parameter or buffer
    the trace reads with ``get_attr``: the trace holds the tensor objects
    it was made with, which ``load_state_dict(assign=True)``, a buffer
    assigned anew or a dtype or device move replace on the module (found
    by an adversarial search: outputs off by up to 10)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != 'get_attr':
            continue
        path, _, name = node.target.rpartition('.')
        owner = module.get_submodule(path)
        if name in owner._parameters or name in owner._buffers:
            found.append([owner, gm.get_submodule(path), name])
    return found


def _rebind(tensors: list) -> bool:
    """Point the trace at the module's parameters and buffers as they are
    now (a trace reads a tensor's shape and dtype when it runs, so another
    one fits), as parameters or buffers as they now are, by their tables
    (``torch.func.functional_call`` puts plain tensors in ``_parameters``,
    which ``setattr`` refuses; found by a review); ``False`` if one is
    ``None`` now."""
    for owner, gm_owner, name in tensors:
        if name in owner._parameters:
            now, table = owner._parameters[name], gm_owner._parameters
            other = gm_owner._buffers
        else:
            now, table = owner._buffers.get(name), gm_owner._buffers
            other = gm_owner._parameters
        if now is None:
            return False
        if table.get(name) is not now:
            other.pop(name, None)
            table[name] = now
    return True


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
