"""Resolve module names and glob patterns against ``named_modules()``.

Memory techniques are switched on for sub-modules named in a config, e.g.
``'backbone.layer1'`` or ``'backbone.layer*'``. This module turns such names
into the modules they denote, and fails with the closest existing names when
one does not match, before anything is changed.

Pattern syntax, matched segment by segment on the dotted names of
:meth:`torch.nn.Module.named_modules`:

- a plain name matches exactly that module;
- ``*``, ``?`` and ``[...]`` match within one segment (``fnmatch`` rules), so
  ``'backbone.layer*'`` matches ``backbone.layer1`` but not
  ``backbone.layer1.0``;
- a ``**`` segment matches any number of segments, including none, so
  ``'**.attn'`` matches every module named ``attn`` at any depth.
"""
import difflib
from fnmatch import fnmatchcase
from typing import Dict, List, Sequence, Union

import torch.nn as nn

from mmdtr.errors import MmdtrError

_GLOB_CHARS = frozenset('*?[')


def _match_segments(pattern: Sequence[str], name: Sequence[str]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == '**':
        return any(
            _match_segments(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _match_segments(
        rest, name[1:])


def match_pattern(pattern: str, name: str) -> bool:
    """Whether the dotted module ``name`` matches the glob ``pattern``.

    Args:
        pattern (str): A module name or glob pattern (see module docstring).
        name (str): A dotted module name from ``named_modules()``.

    Returns:
        bool: True if it matches.
    """
    return _match_segments(pattern.split('.'), name.split('.'))


def closest_names(query: str, names: Sequence[str], n: int = 3) -> List[str]:
    """Return up to ``n`` names of ``names`` closest to ``query`` (difflib).

    Args:
        query (str): The unknown name or pattern.
        names (Sequence[str]): The existing names.
        n (int): How many to return at most. Defaults to 3.

    Returns:
        list[str]: The closest names, best first; may be empty.
    """
    stem = query
    for index, char in enumerate(query):
        if char in _GLOB_CHARS:
            stem = query[:index].rstrip('.')
            break
    return difflib.get_close_matches(stem or query, names, n=n, cutoff=0.5)


def as_name_list(patterns: Union[str, Sequence[str]], key: str) -> List[str]:
    """Check that ``patterns`` is a name or a non-empty list of names.

    Args:
        patterns (str | Sequence[str]): The value to check.
        key (str): The config key, quoted in the error.

    Returns:
        list[str]: The names as a list.

    Raises:
        MmdtrError: If ``patterns`` is not a non-empty str or a non-empty
            list/tuple of non-empty str.
    """
    given = patterns
    if isinstance(patterns, str):
        patterns = [patterns]
    if (not isinstance(patterns, (list, tuple)) or not patterns
            or not all(isinstance(p, str) and p for p in patterns)):
        raise MmdtrError(
            f'{key}={given!r} is not accepted: expected a module name or '
            'a non-empty list of module names (non-empty strings).',
            hint="e.g. 'backbone.layer1' or ['backbone.layer*', 'neck'].")
    return list(patterns)


def resolve_modules(model: nn.Module,
                    patterns: Union[str, Sequence[str]],
                    key: str = 'modules') -> Dict[str, nn.Module]:
    """Resolve names and glob patterns to the sub-modules they denote.

    Every pattern is checked before anything is returned, so a caller that
    resolves first and changes the model afterwards never half-applies a
    technique.

    Args:
        model (nn.Module): The model whose ``named_modules()`` are searched.
        patterns (str | Sequence[str]): Module names or glob patterns.
        key (str): The config key being resolved, quoted in errors.
            Defaults to ``'modules'``.

    Returns:
        dict[str, nn.Module]: Matched names to modules, in
        ``named_modules()`` order, each module once (under its first name
        when it is shared).

    Raises:
        MmdtrError: If ``patterns`` is malformed, names the root module, or
            any name or pattern matches no sub-module; the message lists the
            closest existing names.

    Examples:
        >>> resolve_modules(model, ['backbone.layer*', 'neck'])
        {'backbone.layer1': ..., 'backbone.layer2': ..., 'neck': ...}
    """
    patterns = as_name_list(patterns, key)
    named = [(name, module)
             for name, module in model.named_modules(remove_duplicate=False)
             if name]
    names = [name for name, _ in named]
    matched = set()
    for pattern in patterns:
        hits = {name for name in names if match_pattern(pattern, name)}
        if not hits:
            close = closest_names(pattern, names)
            top = sorted({name.split('.')[0] for name in names})
            suggestion = (f'closest matches: {close}'
                          if close else f'top-level modules: {top}')
            raise MmdtrError(
                f'{key}: no sub-module of {type(model).__name__} matches '
                f'{pattern!r}; {suggestion}. Accepted: names of '
                'model.named_modules() or glob patterns on them.',
                hint="'*' matches within one dotted segment, '**' matches "
                'any number of segments.')
        matched |= hits
    seen = set()
    result = {}
    for name, module in named:
        if name in matched and id(module) not in seen:
            seen.add(id(module))
            result[name] = module
    return result


def outermost(names: Sequence[str]) -> List[str]:
    """Drop the names that lie inside another name of ``names``.

    Args:
        names (Sequence[str]): Dotted module names.

    Returns:
        list[str]: The names with no ancestor in ``names``, in input order.

    Examples:
        >>> outermost(['backbone', 'backbone.layer1', 'neck'])
        ['backbone', 'neck']
    """
    chosen = set(names)

    def has_ancestor(name: str) -> bool:
        parts = name.split('.')
        return any('.'.join(parts[:i]) in chosen for i in range(1, len(parts)))

    return [name for name in names if not has_ancestor(name)]


def _is_container(module: nn.Module) -> bool:
    """A module without a forward of its own (``nn.ModuleList``,
    ``nn.ModuleDict``, a plain ``nn.Module`` holding others): its parent
    calls its members, never it."""
    return 'forward' not in module.__dict__ and \
        type(module).forward is nn.Module.forward


def called_modules(model: nn.Module,
                   names: Sequence[str],
                   key: str = 'modules') -> List[str]:
    """``names``, but those inside another of them (:func:`outermost`),
    with each container among them replaced by its members,
    recursively, so that a technique wrapping a module's forward wraps
    modules that are called (``'blocks'``, an ``nn.ModuleList`` the model
    loops over, selects each block; wrapping the list did nothing, found by
    an adversarial search). A container holding no module with a forward
    (an ``nn.ParameterList``, a holder of buffers) stands for nothing. Each
    module is kept once.

    Args:
        model (nn.Module): The model the names are of.
        names (Sequence[str]): Dotted module names.
        key (str): The config key being resolved, quoted in errors.

    Returns:
        list[str]: The names, containers replaced by their members'.

    Raises:
        MmdtrError: If ``names`` stand for no module with a forward.

    Examples:
        >>> called_modules(gpt, ['blocks', 'ln_final'])
        ['blocks.0', 'blocks.1', ..., 'ln_final']
    """
    result, seen = [], set()

    def add(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if not _is_container(module):
            result.append(name)
            return
        for child, member in module.named_children():
            add(f'{name}.{child}', member)

    for name in outermost(names):
        add(name, model.get_submodule(name))
    if names and not result:
        raise MmdtrError(
            f'{key}: {list(names)} hold no module with a forward of its '
            'own: nothing of them is ever called to be wrapped.',
            hint='select the modules that their parents call.')
    return result
