"""What a Conv-BN trace bakes in beyond its module's attributes.

A trace runs the module's Python once. Besides the module's attributes
(:mod:`.traced_forward`), its code may read module-level globals (a scale, a
flag) and the cells of a closure (a decorated forward's), and may check the
type of an argument or of a value made from one (``isinstance(x, Tensor)``,
``torch.is_tensor(x)``): a proxy is not a tensor, so the trace keeps the
branch it took for every call. This module finds the code a trace runs
outside torch and the standard library, guards the globals it loads and the
cells it closes over (:class:`CodeGuard`), refuses code that writes a
global, and gives the tracer proxies that see a type check.

Not seen: ``type(x)`` of a proxy, and code reached other than through the
class's forward (and what it wraps), the methods of the module's classes it
names and the functions its globals and cells hold.
"""
import abc
import dis
import os
import sys
import types
from typing import List

import torch
import torch.fx as fx
import torch.nn as nn

from .guard_values import ABSENT, TraceRefused, how_to_check, same_value

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FX_DIR = os.path.dirname(fx.__file__) + os.sep
_ABC_CHECK = abc.ABCMeta.__instancecheck__.__code__
# Python >= 3.10 lists its standard library; before, its code is scanned
# too (more refusals, never a missed guard)
_LIBRARY_PACKAGES = frozenset(getattr(sys, 'stdlib_module_names',
                                      ())) | {'torch'}


class CodeGuard:
    """A global the code loads, or a cell it closes over, and the value
    the trace saw. Copies of a module share it: a deep copy of a module does
    not copy its code's globals or cells.

    Args:
        read (Callable): Returns the value now (:data:`ABSENT` if gone).
        value: The value the trace saw.
        what (str): Names it in messages.
    """
    __slots__ = ('read', 'value', 'what')

    def __init__(self, read, value, what: str):
        self.value = how_to_check(value, what)
        self.read, self.what = read, what

    def holds(self) -> bool:
        return same_value(self.read(), self.value)

    def __deepcopy__(self, memo):
        return self


def _global(namespace: dict, name: str):
    return lambda: namespace.get(name, ABSENT)


def _cell(cell):

    def read():
        try:
            return cell.cell_contents
        except ValueError:  # emptied
            return ABSENT

    return read


def is_library_class(klass: type) -> bool:
    """torch's or a builtin: its methods and attributes are not the
    model's."""
    return klass.__module__.split('.')[0] in ('torch', 'builtins')


def _is_library(function: types.FunctionType) -> bool:
    """torch's or the standard library's: not the model's code."""
    package = (getattr(function, '__module__', None) or '').split('.')[0]
    return package in _LIBRARY_PACKAGES


def _codes(code: types.CodeType):
    """``code`` and the code nested in it (closures, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _globals_of(code: types.CodeType):
    """``(names loaded, names stored or deleted)`` as globals."""
    loads, stores = set(), set()
    for inner in _codes(code):
        for ins in dis.get_instructions(inner):
            if ins.opname == 'LOAD_GLOBAL':
                loads.add(ins.argval)
            elif ins.opname in ('STORE_GLOBAL', 'DELETE_GLOBAL'):
                stores.add(ins.argval)
    return loads, stores


def _function_in(value):
    """The Python function ``value`` runs, if it is one (a property's
    getter, a static or class method's function)."""
    value = value.fget if isinstance(value, property) else getattr(
        value, '__func__', value)
    return value if isinstance(value, types.FunctionType) else None


def guard_code(module: nn.Module) -> List[CodeGuard]:
    """Guards on the globals and closure cells the code a trace of
    ``module`` runs reads: the class's forward and what it wraps
    (``__wrapped__``, closure cells), the methods of the module's and its
    sub-modules' classes it names, and the functions these hold, outside
    torch and the standard library.

    Args:
        module (nn.Module): The module whose forward will be traced.

    Returns:
        list[CodeGuard]: One per global (per namespace) and cell.

    Raises:
        TraceRefused: If that code writes a global, or reads one (or a
            cell) whose changes cannot be checked.
    """
    classes = [
        klass for m in module.modules() for klass in type(m).__mro__
        if not is_library_class(klass)
    ]
    guards, seen, todo = {}, set(), [type(module).forward]
    while todo:
        function = _function_in(todo.pop())
        if function is None or function in seen or _is_library(function):
            continue
        seen.add(function)
        todo.append(getattr(function, '__wrapped__', None))
        namespace, code = function.__globals__, function.__code__
        loads, stores = _globals_of(code)
        if stores:
            raise TraceRefused(
                f'its code ({function.__qualname__}) sets the global '
                f'{sorted(stores)[0]}, which a trace would not do')
        for name in loads & namespace.keys():
            key = (id(namespace), name)
            if key not in guards:
                value = namespace[name]
                guards[key] = CodeGuard(
                    _global(namespace, name), value,
                    f"the global {namespace.get('__name__')}.{name}")
                todo.append(value)
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            if id(cell) not in guards:
                value = _cell(cell)()
                guards[id(cell)] = CodeGuard(
                    _cell(cell), value,
                    f'{name} of the closure of {function.__qualname__}')
                todo.append(value)
        for name in set().union(*(c.co_names for c in _codes(code))):
            todo += [vars(klass).get(name) for klass in classes]
    return list(guards.values())


class TypeWatchingTracer(fx.Tracer):
    """An ``fx.Tracer`` whose proxies see a type check by code other than
    torch.fx's own (the module's, or ``torch.is_tensor``): ``type_checks``
    lists where.

    ``isinstance(proxy, C)`` reads ``proxy.__class__`` when the proxy's
    type is not ``C``; a ``Parameter`` check, also one made inside an
    ABC's, is counted for its caller.
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
        # a Parameter's metaclass, and an ABC's (torch.fx checks one on
        # PyTorch 2.5, whose check calls the proxy's): the check is its
        # caller's
        while caller is not None and \
                caller.f_code.co_name == '__instancecheck__' and (
                    caller.f_code.co_filename.startswith(_TORCH_DIR)
                    or caller.f_code is _ABC_CHECK):
            caller = caller.f_back
        if caller is not None and \
                not caller.f_code.co_filename.startswith(_FX_DIR):
            self.tracer.type_checks.append(
                f'{caller.f_code.co_name} (line {caller.f_lineno})')
        return _TypeWatchedProxy
