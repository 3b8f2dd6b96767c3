"""Translate mmdtr's memory keys of a config into hooks.

MMEngine's Runner applies its own thin ``activation_checkpointing`` and
``efficient_conv_bn_eval`` keys. mmdtr pops its keys from the config before
the Runner sees them and appends the hooks that implement them to
``custom_hooks``, so every technique is applied once, by mmdtr.

Each key's adapter module registers a translator with :func:`memory_key`.
A translator validates the value (type and shape; names that need the model
are checked by the hook before training starts) and returns the hook config.
All keys are validated before anything is changed, so nothing is
half-applied.

The translated copy keeps the config as written in an attribute (not a
key), :data:`SOURCE_ATTR`, which :class:`~mmdtr.adapters.runner.MMDTRRunner`
dumps to the work dir: a run restarted from the dumped config translates the
keys again, and ``--cfg-options`` on them still take effect.
"""
import copy
import difflib
import inspect
from typing import Callable, Dict, List

from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import get_priority

from mmdtr.errors import MmdtrError
from mmdtr.registry import HOOKS
from .near_miss_keys import refuse_near_misses
from .registered_types import (check_registered_type, check_scoped_type,
                               may_be_mmdtrs)

#: key name -> translator ``fn(value) -> hook cfg dict``
MEMORY_KEY_TRANSLATORS: Dict[str, Callable[[object], dict]] = {}
#: key name -> name of the hook class its translator configures
MEMORY_KEY_HOOKS: Dict[str, str] = {}
#: hooks that may appear once in ``custom_hooks``
ONCE_HOOKS = set()
#: checks ``fn(cfg, custom_hooks)`` of the whole translated config
CONFIG_CHECKS: List[Callable[[object, list], None]] = []
#: attribute of a translated Config (not a key: never dumped or merged)
#: holding the config as written, with mmdtr's keys
SOURCE_ATTR = '_mmdtr_source'


def memory_key(name: str, hook: str, once: bool = False) -> Callable:
    """Register the translator of config key ``name``.

    Args:
        name (str): The top-level config key, e.g. ``'dtr'``.
        hook (str): The name of the hook class it configures, e.g.
            ``'DTRHook'``: the key and that hook in ``custom_hooks`` are
            refused together.
        once (bool): Whether two such hooks in ``custom_hooks`` are refused
            too (one engine per process: ``DTRHook``). Defaults to False.

    Returns:
        Callable: A decorator taking ``fn(value) -> dict`` (the hook config).

    Examples:
        >>> @memory_key('my_key', hook='MyHook')
        ... def _translate(value):
        ...     return dict(type='mmdtr.MyHook', option=value)
    """

    def register(fn: Callable[[object], dict]) -> Callable[[object], dict]:
        if name in MEMORY_KEY_TRANSLATORS:
            raise MmdtrError(
                f'config key {name!r} is registered twice.',
                hint='register each key once, in its adapter.')
        MEMORY_KEY_TRANSLATORS[name] = fn
        MEMORY_KEY_HOOKS[name] = hook
        if once:
            ONCE_HOOKS.add(hook)
        return fn

    return register


def config_check(fn: Callable[[object, list], None]) -> Callable:
    """Register a check of the whole config, run when it is translated.

    The check gets the config and its final ``custom_hooks`` (the keys'
    hooks included) and raises :class:`MmdtrError` on a combination that
    cannot work; it changes nothing.

    Examples:
        >>> @config_check
        ... def _check(cfg, custom_hooks):
        ...     if cfg.get('compile') and custom_hooks:
        ...         raise MmdtrError('...', hint='...')
    """
    CONFIG_CHECKS.append(fn)
    return fn


def translate_memory_keys(cfg: Config) -> Config:
    """Return a copy of ``cfg`` with mmdtr's memory keys turned into hooks.

    Keys that are absent or ``None`` are dropped and mean "off". The keys
    are gone from the copy, so translating it again changes nothing.

    Args:
        cfg (Config): The config, as loaded by ``Config.fromfile``.

    Returns:
        Config: The translated copy; ``cfg`` itself is left untouched.

    Raises:
        MmdtrError: If any key, or any of the keys' hooks in
            ``custom_hooks``, has a bad value, a top-level key looks like a
            misspelt memory key, or a registered :func:`config_check`
            refuses a combination; nothing is changed then.
    """
    refuse_near_misses(cfg, MEMORY_KEY_TRANSLATORS)
    hooks = []
    custom_hooks = _custom_hooks(
        cfg.get('custom_hooks', None), cfg.get('default_scope', None))
    for name, translate in MEMORY_KEY_TRANSLATORS.items():
        value = cfg.get(name, None)
        if value is None:
            continue
        hook = translate(value)  # raises before anything changes
        for i, other in enumerate(custom_hooks):
            if hook_name(other) == hook_name(hook):
                raise MmdtrError(
                    f'{name}={value!r} and custom_hooks[{i}]={other!r} both '
                    f'configure {hook_name(hook)}.',
                    hint=f'configure it once: keep the {name} key or the '
                    'hook, not both.')
        hooks.append(hook)
    _refuse_repeated_hooks(custom_hooks)
    _check_hook_arguments(custom_hooks)
    _refuse_default_memory_hooks(
        cfg.get('default_hooks', None), cfg.get('default_scope', None))
    for check in CONFIG_CHECKS:
        check(cfg, custom_hooks + hooks)
    out = copy.deepcopy(cfg)
    for name in MEMORY_KEY_TRANSLATORS:
        out.pop(name, None)
    out.custom_hooks = custom_hooks + hooks
    source = getattr(cfg, SOURCE_ATTR, None) if not hooks else None
    object.__setattr__(out, SOURCE_ATTR, source or copy.deepcopy(cfg))
    return out


def refuse_runner_key(runner, key: str, hook: Hook) -> None:
    """Refuse ``hook`` on a runner whose config still holds ``key``.

    MMEngine's own Runner applies its ``activation_checkpointing`` and
    ``efficient_conv_bn_eval`` keys itself, after ``before_run``; with
    mmdtr's hook for the same key, the technique would be applied twice (a
    reentrant checkpoint around mmdtr's left the modules without
    gradients). :class:`~mmdtr.adapters.runner.MMDTRRunner` translates the
    key into the hook, so its config never holds both.

    Args:
        runner (Runner): The runner, in ``before_run``.
        key (str): The config key the hook implements.
        hook (Hook): The hook.

    Raises:
        MmdtrError: If ``runner.cfg`` sets ``key``.
    """
    value = runner.cfg.get(key, None)
    if value is not None:
        raise MmdtrError(
            f'{key} is configured twice: {key}={value!r}, which '
            f"MMEngine's Runner applies itself, and {type(hook).__name__}"
            f'(modules={hook.modules!r}) in custom_hooks.',
            hint=f"keep one of them; runner_type='mmdtr.MMDTRRunner' (or "
            f'tools/train.py) turns the {key} key into this hook.')


def _custom_hooks(value, default_scope) -> list:
    """``custom_hooks`` as a list, refused unless it is a list of hook
    configs (dicts with a type, or hooks) of types that exist in the
    config's scope and valid priorities; MMEngine would fail on them later,
    in a traceback (a dict without its brackets was read as the list of its
    keys)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise MmdtrError(
            f'custom_hooks={value!r} is not accepted: MMEngine takes a list '
            'of hook configs.',
            hint="write custom_hooks=[dict(type='mmdtr.DTRHook', "
            "eviction_threshold='5GB')], in brackets, or use the memory "
            'keys (dtr=dict(eviction_threshold=...)).')
    for i, hook in enumerate(value):
        if isinstance(hook, Hook):
            continue
        if not isinstance(hook, dict) or 'type' not in hook:
            raise MmdtrError(
                f'custom_hooks[{i}]={hook!r} is not accepted: a hook config '
                'is a dict with a type (or a Hook object).',
                hint="e.g. dict(type='mmdtr.DTRHook', "
                "eviction_threshold='5GB').")
        check_scoped_type(f'custom_hooks[{i}]', hook, HOOKS, default_scope)
        check_registered_type(f'custom_hooks[{i}]', hook['type'], HOOKS,
                              'hook')
        if 'priority' in hook:
            try:
                if isinstance(hook['priority'], bool):  # an int to MMEngine
                    raise TypeError
                get_priority(hook['priority'])
            except (KeyError, TypeError, ValueError):
                raise MmdtrError(
                    f'custom_hooks[{i}]: priority={hook["priority"]!r} is '
                    'not accepted.',
                    hint="an int from 0 to 100, or a name of MMEngine's "
                    "Priority such as 'NORMAL' or 'LOW'.") from None
    return list(value)


def refuse_unless_dict(key: str, value, takes: str, hint: str) -> None:
    """Refuse a config ``value`` of ``key`` that is not a dict (``None``
    passes: left out)."""
    if value is not None and not isinstance(value, dict):
        raise MmdtrError(
            f'{key}={value!r} is not accepted: MMEngine takes {takes}.',
            hint=hint)


def _refuse_default_memory_hooks(default_hooks, default_scope) -> None:
    """A hook of mmdtr's keys in ``default_hooks``: MMEngine builds any hook
    there, but the checks above read ``custom_hooks`` and the keys, so a bad
    value failed after the work dir was made, and the hook next to its key
    ran twice (DTR's second engine refused at the first iteration; found by
    an adversarial search)."""
    if not isinstance(default_hooks, dict):
        return  # MMEngine names it
    for key, hook in default_hooks.items():
        name = hook_name(hook)
        if name not in MEMORY_KEY_HOOKS.values() or not may_be_mmdtrs(
                hook, default_scope):
            continue
        memory_key = next(k for k, v in MEMORY_KEY_HOOKS.items() if v == name)
        raise MmdtrError(
            f'default_hooks.{key}={hook!r}: mmdtr\'s {name} is configured '
            'by its key or in custom_hooks, where its values and a second '
            'configuration are checked before training; default_hooks are '
            "MMEngine's own.",
            hint=f'use the {memory_key} key, or move the hook to '
            f"custom_hooks=[dict(type='mmdtr.{name}', ...)].")


def _refuse_repeated_hooks(custom_hooks: list) -> None:
    """Two hooks of a class registered ``once`` in ``custom_hooks``."""
    seen = {}
    for i, hook in enumerate(custom_hooks):
        name = hook_name(hook)
        if name in ONCE_HOOKS:
            if name in seen:
                raise MmdtrError(
                    f'custom_hooks[{seen[name]}] and custom_hooks[{i}] both '
                    f'configure {name}: {custom_hooks[seen[name]]!r} and '
                    f'{hook!r}.',
                    hint='configure it once.')
            seen[name] = i


def _check_hook_arguments(custom_hooks: list) -> None:
    """Build the keys' hooks given in ``custom_hooks`` once, to check their
    arguments now rather than when the runner is built."""
    for i, hook in enumerate(custom_hooks):
        if isinstance(hook, Hook) or \
                hook_name(hook) not in MEMORY_KEY_HOOKS.values():
            continue  # a hook object was checked when it was made (it
            # raised a TypeError here; found by a review)
        cls = hook['type'] if isinstance(hook['type'], type) else \
            HOOKS.get(hook['type'])
        if cls is None:  # not mmdtr's: MMEngine will name it
            continue
        # MMEngine pops `priority` and the registry's `_scope_` first
        kwargs = {
            k: v
            for k, v in hook.items()
            if k not in ('type', 'priority', '_scope_')
        }
        accepted = list(inspect.signature(cls).parameters)
        unknown = [k for k in kwargs if k not in accepted]
        if unknown:
            close = {
                k: difflib.get_close_matches(str(k), accepted, n=1)
                for k in unknown
            }
            raise MmdtrError(
                f'custom_hooks[{i}]={hook!r} is not accepted: '
                f'{hook_name(hook)} takes {accepted}.',
                hint=f'closest matches: {close}.')
        try:
            cls(**kwargs)
        except MmdtrError as e:
            raise MmdtrError(
                f'custom_hooks[{i}]={hook!r}: {e.message}', hint=e.hint) from e
        except TypeError as e:  # a required argument missing
            raise MmdtrError(
                f'custom_hooks[{i}]={hook!r} is not accepted: {e}.',
                hint=f'{hook_name(hook)} takes {accepted}.') from e


def hook_name(hook_cfg) -> str:
    """A hook config's type, without its registry scope (``'DTRHook'``);
    for a hook object, its class name (the checks for a hook configured
    twice skipped objects; found by an adversarial search)."""
    if isinstance(hook_cfg, Hook):
        return type(hook_cfg).__name__
    hook_type = hook_cfg.get('type', '') if isinstance(hook_cfg, dict) else ''
    hook_type = getattr(hook_type, '__name__', hook_type)
    return str(hook_type).split('.')[-1]
