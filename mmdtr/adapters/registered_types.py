"""Checks of the ``type`` names a config gives, looked up as MMEngine's
builders look them up (its registries and scopes), before the runner is
built: a name only mmdtr registers under another scope, a name no registry
of mmdtr's or MMEngine's scope holds, a ``type`` that is not a name or a
class. Other scopes' names are left to MMEngine: their registries may not
be imported yet.
"""
import difflib
import importlib
import inspect

from mmdtr.errors import MmdtrError


def check_registered_type(where: str, name, registry, kind: str) -> None:
    """Refuse a type that is not registered and is mmdtr's (``'mmdtr.X'``)
    or close to one of mmdtr's; other scopes are left to MMEngine (their
    registries may not be imported yet).

    Args:
        where (str): The config key, for the message.
        name: The ``type`` given; only names (strings) are checked.
        registry (Registry): mmdtr's registry of that kind.
        kind (str): What it registers, for the message (``'hook'``).

    Raises:
        MmdtrError: On such a type, naming the closest match.
    """
    if not isinstance(name, str) or registry.get(name) is not None:
        return
    scope, _, short = name.rpartition('.')
    ours = sorted(registry.module_dict)
    close = difflib.get_close_matches(short, ours, n=1, cutoff=0.8)
    if scope == 'mmdtr' or close:
        raise MmdtrError(
            f'{where}: type={name!r} is not a registered {kind}.',
            hint=f"mmdtr's {kind}s are {ours}" +
            (f'; closest match: {close[0]!r}.' if close else '.'))


def check_scoped_type(where: str, entry: dict, registry,
                      default_scope) -> None:
    """Refuse a type name without a scope that only mmdtr registers when
    the config's scope is not mmdtr's.

    MMEngine's builders look a plain name up in the registry of the
    config's ``default_scope`` (MMEngine's own if unset) and its parents,
    never in mmdtr's, a sibling: ``type='DTRHook'`` failed there with a
    ``KeyError`` when the runner was built.

    Args:
        where (str): The config key, for the message.
        entry (dict): The config that names a ``type`` (a class or a scoped
            name passes); its ``_scope_``, if any, is the scope looked in.
        registry (Registry): mmdtr's registry of that kind.
        default_scope (str | None): The config's ``default_scope``.

    Raises:
        MmdtrError: If the type resolves only in ``registry``.
    """
    name = entry.get('type', None)
    if 'type' in entry:
        check_type_value(where, name)
    scope = entry.get('_scope_', None) or default_scope
    if not isinstance(name, str) or '.' in name or scope == 'mmdtr':
        return
    if mmdtr_only(registry, name) and \
            scope_registry(registry, scope).get(name) is None:
        where_scope = f'scope {scope!r}' if scope else \
            "scope (no default_scope: MMEngine's)"
        raise MmdtrError(
            f"{where}: type={name!r} is mmdtr's, but MMEngine's builder "
            f"looks it up in the config's {where_scope} and does not find "
            'it there.',
            hint=f"write type='mmdtr.{name}' (or set default_scope="
            "'mmdtr').")


def mmdtr_only(registry, name: str) -> bool:
    """Whether ``name`` (no scope) is registered in mmdtr's ``registry``
    and not in MMEngine's root one, which MMEngine looks in without a
    scope."""
    return name in registry.module_dict and \
        name not in registry.parent.module_dict


def check_type_value(where: str, name) -> None:
    """Refuse a ``type`` MMEngine's registries cannot look up: not a class
    or function, nor a name (``'DTRHook'``, ``'mmdtr.DTRHook'``). They
    raised a raw TypeError or RuntimeError in the checks (found by an
    adversarial search)."""
    if isinstance(name, str):
        if name and all(part.isidentifier() for part in name.split('.')):
            return
    elif inspect.isclass(name) or inspect.isfunction(name) or \
            inspect.ismethod(name):
        return
    raise MmdtrError(
        f'{where}: type={name!r} is not accepted: a registered name, '
        "optionally with its scope ('DTRHook', 'mmdtr.DTRHook'), or a class.",
        hint="e.g. type='mmdtr.DTRHook' or type='OptimWrapper'.")


def scope_registry(registry, scope):
    """The registry MMEngine's builder looks a plain name up in under
    ``scope``, as its ``switch_scope_and_registry`` finds it: the scope's
    (a project built on mmdtr's registries finds mmdtr's names through its
    parents), or, if none is imported, the root of ``registry``."""
    root = registry.parent
    if scope is None or scope == root.scope:
        return root
    try:
        importlib.import_module(f'{scope}.registry')
    except (ImportError, AttributeError):
        pass
    found = root._search_child(scope)
    return root if found is None else found


def may_be_mmdtrs(hook, default_scope) -> bool:
    """Whether a hook config's type, or a hook object, may be mmdtr's: a
    class of mmdtr's, ``'mmdtr.X'``, or a plain name under mmdtr's scope or
    none; another scope's (``'mmdet.DTRHook'``, or a plain name under
    ``_scope_='mmdet'``) is its own (two reviews)."""
    kind = hook.get('type', None) if isinstance(hook, dict) else type(hook)
    if isinstance(kind, str):
        if '.' in kind:
            return kind.startswith('mmdtr.')
        scope = hook.get('_scope_', None) or default_scope
        return scope in (None, 'mmdtr')
    return inspect.isclass(kind) and kind.__module__.startswith('mmdtr.')


def of_another_scope(name: str, scope) -> bool:
    """Whether the type ``name`` (``'mmdet.X'``, or a plain name under
    ``scope``) is of a scope other than mmdtr's or MMEngine's: its registry
    may not be imported yet, so it is left to MMEngine."""
    return (name.rpartition('.')[0]
            or scope) not in (None, 'mmdtr', 'mmengine')


def refuse_unregistered(where: str,
                        name,
                        registry,
                        default_scope,
                        list_parent: bool = True,
                        in_scope: bool = True):
    """Refuse a type name of mmdtr's or MMEngine's scope (or of none) that
    neither registers: MMEngine's builder failed on it in ``runner.train()``
    or when the runner was built, in a traceback (``KeyError: 'X is not in
    the runner registry'``, ``TypeError: None is not a callable object``),
    after the work dir was made (found by a review). Other scopes' names
    are left to MMEngine: their registries may not be imported yet.

    Args:
        where (str): The config key, for the message.
        name: The ``type`` given; only names (strings) are checked.
        registry (Registry): mmdtr's registry of that kind (its parent is
            MMEngine's).
        default_scope (str | None): The scope the name is built in: the
            config's ``default_scope``, or the entry's ``_scope_``.
        list_parent (bool): List MMEngine's names in the hint too (the
            closest match is sought among both either way). Defaults to
            True; models: False, as mmcv adds its layers to MMEngine's.
        in_scope (bool): Whether the builder runs under that scope, as the
            runner builds models and optimizers (True), or as a script
            builds its runner (``runner_type``; False): from MMEngine's
            root registry before any scope is set, from another under one
            set before (``init_default_scope``), so a name any of them
            finds passes (the root alone refused a runner a script built;
            found by a review).

    Returns:
        The class (or function) MMEngine's builder will find, or None
        when the name is not checked (a class given, another scope).

    Raises:
        MmdtrError: On such a name, with the closest registered one.
    """
    if not isinstance(name, str) or of_another_scope(name, default_scope):
        return None
    # looked up as MMEngine's builder does (switch_scope_and_registry, then
    # get): 'mmdtr.X' of MMEngine's X resolves from MMEngine's root, not
    # from mmdtr's registry (found by a review)
    scoped = scope_registry(registry, default_scope)
    for lookup in (scoped, ) if in_scope else (registry.parent, registry,
                                               scoped):
        found = lookup.get(name)
        if found is not None:
            return found
    known = sorted({*registry.module_dict, *registry.parent.module_dict})
    close = difflib.get_close_matches(
        name.rpartition('.')[2], known, n=1, cutoff=0.6)
    if close and scoped.get(close[0]) is None:
        # mmdtr's alone, out of its scope: its scoped name is found (the
        # plain one was refused next; found by a review)
        close = [f'{registry.scope}.{close[0]}']
    listed = f'registered: {known}' if list_parent else (
        f"mmdtr's: {sorted(registry.module_dict)}")
    raise MmdtrError(
        f'{where}={name!r} is not registered.',
        hint=(f'closest match: {close[0]!r}; ' if close else '') +
        f'{listed}.')
