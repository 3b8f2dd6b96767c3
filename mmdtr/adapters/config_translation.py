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
from typing import Callable, Dict

from mmengine.config import Config

from mmdtr.errors import MmdtrError

#: key name -> translator ``fn(value) -> hook cfg dict``
MEMORY_KEY_TRANSLATORS: Dict[str, Callable[[object], dict]] = {}
#: attribute of a translated Config (not a key: never dumped or merged)
#: holding the config as written, with mmdtr's keys
SOURCE_ATTR = '_mmdtr_source'


def memory_key(name: str) -> Callable:
    """Register the translator of config key ``name``.

    Args:
        name (str): The top-level config key, e.g. ``'dtr'``.

    Returns:
        Callable: A decorator taking ``fn(value) -> dict`` (the hook config).

    Examples:
        >>> @memory_key('my_key')
        ... def _translate(value):
        ...     return dict(type='mmdtr.MyHook', option=value)
    """

    def register(fn: Callable[[object], dict]) -> Callable[[object], dict]:
        if name in MEMORY_KEY_TRANSLATORS:
            raise MmdtrError(f'config key {name!r} is registered twice.')
        MEMORY_KEY_TRANSLATORS[name] = fn
        return fn

    return register


def translate_memory_keys(cfg: Config) -> Config:
    """Return a copy of ``cfg`` with mmdtr's memory keys turned into hooks.

    Keys that are absent or ``None`` are dropped and mean "off". The keys
    are gone from the copy, so translating it again changes nothing.

    Args:
        cfg (Config): The config, as loaded by ``Config.fromfile``.

    Returns:
        Config: The translated copy; ``cfg`` itself is left untouched.

    Raises:
        MmdtrError: If any key has a bad value; nothing is changed then.
    """
    hooks = []
    custom_hooks = list(cfg.get('custom_hooks', None) or [])
    for name, translate in MEMORY_KEY_TRANSLATORS.items():
        value = cfg.get(name, None)
        if value is None:
            continue
        hook = translate(value)  # raises before anything changes
        for i, other in enumerate(custom_hooks):
            if _hook_name(other) == _hook_name(hook):
                raise MmdtrError(
                    f'{name}={value!r} and custom_hooks[{i}]={other!r} both '
                    f'configure {_hook_name(hook)}.',
                    hint=f'configure it once: keep the {name} key or the '
                    'hook, not both.')
        hooks.append(hook)
    out = copy.deepcopy(cfg)
    for name in MEMORY_KEY_TRANSLATORS:
        out.pop(name, None)
    out.custom_hooks = custom_hooks + hooks
    source = getattr(cfg, SOURCE_ATTR, None) if not hooks else None
    object.__setattr__(out, SOURCE_ATTR, source or copy.deepcopy(cfg))
    return out


def _hook_name(hook_cfg) -> str:
    """A hook config's type, without its registry scope (``'DTRHook'``)."""
    hook_type = hook_cfg.get('type', '') if isinstance(hook_cfg, dict) else ''
    hook_type = getattr(hook_type, '__name__', hook_type)
    return str(hook_type).split('.')[-1]
