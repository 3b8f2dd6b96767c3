"""Top-level config keys that mmdtr would ignore although they were meant
for it: refused when the config is read.

MMEngine ignores a top-level key it does not know, and so would mmdtr:
a misspelt memory key (``DTR``, ``dtr_cfg``, ``activation_checkpoint``), a
name users try first (``use_dtr``, ``gradient_checkpointing``), or a setting
written at the top level instead of inside its section
(``--cfg-options eviction_threshold=3GB`` for ``dtr.eviction_threshold``).
Each trained silently without the feature.
"""
import difflib
import types
from typing import Iterable, Mapping

from mmdtr.errors import MmdtrError

#: Other names users give mmdtr's keys.
ALIASES = {
    'dtr': ('use_dtr', 'enable_dtr', 'dtr_enabled', 'dtrs'),
    'activation_checkpointing':
    ('checkpointing', 'gradient_checkpointing', 'activation_ckpt',
     'grad_checkpointing', 'with_cp'),
    'efficient_conv_bn_eval': ('conv_bn_eval', 'efficient_conv_bn'),
}
#: A section's setting -> the section that reads it.
SETTING_SECTIONS = {
    'eviction_threshold': 'dtr',
    'evictee_minimum_size': 'dtr',
    'enable_sqrt_sampling': 'dtr',
    'accumulative_counts': 'optim_wrapper',
    'step_in_backward': 'optim_wrapper',
}


def _imported(value) -> bool:
    """An imported name (``from mmdet.models import DETR``), not a key."""
    return isinstance(value, (type, types.ModuleType, types.FunctionType)) \
        or type(value).__name__.startswith('Lazy')


def _meant_key(key: str, names: Iterable[str], cfg) -> str:
    """The memory key ``key`` looks meant for, or ``''``."""
    lowered = key.lower()
    for name in names:
        if name in cfg:
            continue  # the key itself is there: a variable named after it
        close = len(name) > 4 and difflib.SequenceMatcher(None, lowered,
                                                          name).ratio() >= 0.8
        if lowered == name or lowered.startswith(name + '_') or close \
                or lowered in ALIASES.get(name, ()):
            return name
    return ''


def _section_values(section, setting: str) -> list:
    """The values of ``setting`` in ``section`` and in its dicts one level
    down (an ``OptimWrapperDict``'s wrappers)."""
    if not isinstance(section, Mapping):
        return []
    found = [section[setting]] if setting in section else []
    return found + [
        value[setting] for value in section.values()
        if isinstance(value, Mapping) and setting in value
    ]


def refuse_near_misses(cfg, names: Iterable[str]) -> None:
    """Refuse a top-level key of ``cfg`` that looks meant for mmdtr.

    That is a key like a memory key of ``names`` (misspelt, or one of its
    :data:`ALIASES`) while that key is absent, or a setting of
    :data:`SETTING_SECTIONS` whose section does not hold the same value (a
    variable the section reads is left alone).

    Args:
        cfg (Config): The config as loaded.
        names (Iterable[str]): mmdtr's memory keys (``'dtr'``, ...).

    Raises:
        MmdtrError: On the first such key.
    """
    names = list(names)
    for key in cfg.keys():
        if key in names or key.startswith('_') or _imported(cfg[key]):
            continue
        meant = _meant_key(key, names, cfg)
        if meant:
            raise MmdtrError(
                f'{key}={cfg[key]!r}: is it the {meant!r} key? mmdtr reads '
                f'{sorted(names)} and would ignore it.',
                hint=f'rename it to {meant!r}, or, if it is not meant for '
                'mmdtr, to a name that does not resemble it.')
        section = SETTING_SECTIONS.get(key)
        if section is not None and \
                cfg[key] not in _section_values(cfg.get(section), key):
            raise MmdtrError(
                f'{key}={cfg[key]!r} is a top-level key: it is read only as '
                f'{section}.{key}, so it would be ignored.',
                hint=f'give it as {section}.{key} (--cfg-options '
                f'{section}.{key}=...), or, if it is a variable, use it in '
                f'{section}.')
