"""Top-level config keys that mmdtr would ignore although they were meant
for it: refused when the config is read.

MMEngine ignores a top-level key it does not know, and so would mmdtr:
a misspelt memory key (``DTR``, ``dtr_cfg``, ``activation_checkpoint``), a
name users try first (``use_dtr``), or a setting written at the top level
while nothing reads it there (``eviction_threshold='3GB'`` without a ``dtr``
key). Each trained silently without the feature; a variable named after
a key whose feature is on otherwise (a hook in ``custom_hooks``) is left
alone. A setting given at the
top level through ``--cfg-options`` is refused by
:func:`refuse_top_level_settings`. One level too deep, in ``model`` or
``train_cfg``, mmdtr's keys reach a constructor that takes none of them, and
``env_cfg`` ignores them.
"""
import difflib
import types
from typing import Iterable, Mapping

from mmdtr.errors import MmdtrError

#: Other names users give mmdtr's keys.
#: Only names no other project uses for a variable of its own
#: (``with_cp``, ``gradient_checkpointing`` are model arguments elsewhere).
ALIASES = {
    'dtr': ('use_dtr', 'enable_dtr', 'dtr_enabled', 'dtrs'),
    'activation_checkpointing': ('activation_ckpt', ),
    'efficient_conv_bn_eval': ('conv_bn_eval', 'efficient_conv_bn'),
}
#: A section's setting -> the section that reads it.
SETTING_SECTIONS = {
    'eviction_threshold': 'dtr',
    'evictee_minimum_size': 'dtr',
    'enable_sqrt_sampling': 'dtr',
    'recording_threshold': 'dtr',
    'accumulative_counts': 'optim_wrapper',
    'step_in_backward': 'optim_wrapper',
}
#: Sub-keys of several sections, refused at the top level of
#: ``--cfg-options`` only (a config's own variable may be named so).
OPTION_SETTINGS = {
    'policy': ('dtr', 'activation_checkpointing'),
    'modules': ('activation_checkpointing', 'efficient_conv_bn_eval'),
    # the optimizer wrapper's, and common names for a config's variables
    'clip_grad': ('optim_wrapper', ),
    'amp': ('optim_wrapper', ),  # InplaceOptimWrapper's
}


def _imported(value) -> bool:
    """An imported name (``from mmdet.models import DETR``), not a key."""
    return isinstance(value, (type, types.ModuleType, types.FunctionType)) \
        or type(value).__name__.startswith('Lazy')


#: A memory key -> the hook that enables its feature without it.
FEATURE_HOOKS = {
    'dtr': 'DTRHook',
    'activation_checkpointing': 'ActivationCheckpointingHook',
    'efficient_conv_bn_eval': 'EfficientConvBnEvalHook',
}


def _enabled_otherwise(cfg, name: str) -> bool:
    """Whether the feature of memory key ``name`` is on without the key: its
    hook in ``custom_hooks``, or, for DTR, ``model_wrapper_cfg.dtr``. A
    top-level variable (``dtr_cfg = dict(...)``) may then feed it, and
    nothing trains without the feature (found by a review)."""
    hooks = cfg.get('custom_hooks') or ()
    hook = FEATURE_HOOKS.get(name)
    if hook and isinstance(hooks, (list, tuple)) and any(
            isinstance(h, Mapping) and hook in str(h.get('type', ''))
            for h in hooks):
        return True
    wrapper = cfg.get('model_wrapper_cfg')
    return name == 'dtr' and isinstance(
        wrapper, Mapping) and wrapper.get('dtr') is not None


def _meant_key(key: str, names: Iterable[str], cfg) -> str:
    """The memory key ``key`` looks meant for, or ``''``."""
    lowered = key.lower()
    for name in names:
        if name in cfg or _enabled_otherwise(cfg, name):
            continue  # the key itself is there, or its feature is on: a
            # variable named after it
        close = len(name) > 4 and difflib.SequenceMatcher(None, lowered,
                                                          name).ratio() >= 0.8
        # a short name holding DTR's settings: dtrr, dt (too short for the
        # ratio above; found by an adversarial search)
        slip = name == 'dtr' and len(lowered) <= 5 and isinstance(
            cfg[key], Mapping) and any(s in cfg[key] for s in _DTR_SETTINGS) \
            and difflib.SequenceMatcher(None, lowered, name).ratio() >= 0.6
        if lowered == name or lowered.startswith(name + '_') or close \
                or lowered in ALIASES.get(name, ()) or slip:
            return name
    return ''


def _holds(section, setting: str) -> bool:
    """Whether ``section`` (a dict), or one of its dicts one level down (an
    ``OptimWrapperDict``'s wrappers), has the key ``setting``."""
    if not isinstance(section, Mapping):
        return False
    return setting in section or any(
        isinstance(value, Mapping) and setting in value
        for value in section.values())


def _read(cfg, setting: str) -> bool:
    """Whether a config part that takes ``setting`` is there: its section
    with the key; for DTR's, also a DTRHook in ``custom_hooks`` or
    ``model_wrapper_cfg.dtr`` (a top-level variable may feed either)."""
    section = SETTING_SECTIONS[setting]
    if _holds(cfg.get(section), setting):
        return True
    return section == 'dtr' and _enabled_otherwise(cfg, 'dtr')


def refuse_near_misses(cfg, names: Iterable[str]) -> None:
    """Refuse a top-level key of ``cfg`` that looks meant for mmdtr.

    That is a key like a memory key of ``names`` (misspelt, or one of its
    :data:`ALIASES`) while that key is absent, or a setting of
    :data:`SETTING_SECTIONS` while nothing that takes it is in the config
    (a variable its section reads is left alone), or mmdtr's key or
    setting inside ``model``, ``train_cfg`` or ``env_cfg``.

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
        if key in SETTING_SECTIONS and not _read(cfg, key):
            raise _misplaced(key, cfg[key])
    _refuse_nested(cfg, names)


#: DTR's settings: no model or train loop takes these names.
_DTR_SETTINGS = tuple(k for k, v in SETTING_SECTIONS.items() if v == 'dtr')
#: MMEngine's train loops, which take none of mmdtr's keys.
_MMENGINE_LOOPS = ('IterBasedTrainLoop', 'EpochBasedTrainLoop')
_BUILT = dict(
    model="MMEngine's build of the model, not mmdtr (a TypeError after the "
    'work dir is made, where it takes no such argument)',
    train_cfg="MMEngine's build of the train loop, not mmdtr (a TypeError "
    'after the work dir is made, where it takes no such argument)',
    env_cfg="MMEngine's environment setup, which ignores it: training would "
    'run without it')


def nested_key_error(section: str, key: str, value) -> MmdtrError:
    """The error for mmdtr's ``key`` (a memory key or a setting of
    :data:`SETTING_SECTIONS`) given one level too deep, in ``section``
    (``'model'``, ``'train_cfg'`` or ``'env_cfg'``)."""
    where = SETTING_SECTIONS.get(key)
    place = f'{where}.{key}' if where else f'the top-level {key} key'
    if where:
        option = f'{where}.{key}=...'
    else:  # a memory key: a dict of settings, or module names
        option = f'{key}.<setting>=...' if isinstance(value, Mapping) \
            else f'{key}=...'
    return MmdtrError(
        f'{section}.{key}={value!r}: it is read only as {place}; in '
        f'{section} it reaches {_BUILT[section]}.',
        hint=f'move it to {place} (--cfg-options {option}).')


def _refuse_nested(cfg, names: list) -> None:
    """Refuse mmdtr's keys one level too deep: in ``model`` (``dtr`` and
    DTR's settings; the others where the model does not take them, in
    :mod:`~mmdtr.adapters.model_data_checks`), ``train_cfg`` (any of them;
    for a loop other than MMEngine's, not the optimizer wrapper's settings,
    which another loop may take) and ``env_cfg`` (any). MMEngine passed them
    to the constructor, which failed in a raw ``TypeError`` after the work
    dir was made, and ``--check-config`` accepted them (found by an
    adversarial search); ``env_cfg`` ignored them (found by another)."""
    loop = cfg.get('train_cfg')
    loop_type = loop.get('type', '') if isinstance(loop, Mapping) else ''
    # a new-style config's type is the class (a review)
    loop_type = loop_type.__name__ if isinstance(
        loop_type, type) else str(loop_type).split('.')[-1]
    every = list(names) + list(SETTING_SECTIONS)
    in_loop = every
    if loop_type and loop_type not in _MMENGINE_LOOPS:
        in_loop = [
            k for k in in_loop if SETTING_SECTIONS.get(k) != 'optim_wrapper'
        ]
    nested = (('model', ('dtr', ) + _DTR_SETTINGS), ('train_cfg', in_loop),
              ('env_cfg', every))
    for section, keys in nested:
        value = cfg.get(section)
        if not isinstance(value, Mapping):
            continue
        for key in keys:
            if key in value:
                raise nested_key_error(section, key, value[key])


def refuse_top_level_settings(options: Mapping) -> None:
    """Refuse ``--cfg-options`` that set a setting of
    :data:`SETTING_SECTIONS` at the top level: a config's variables are
    resolved when it is read, so such an option reaches nothing (the demo
    kept its threshold; found by an adversarial search).

    The sub-keys of :data:`OPTION_SETTINGS` (``policy=lru``) are refused
    too: MMEngine reads no such top-level key either.

    Args:
        options (Mapping): The options, dotted keys as given.

    Raises:
        MmdtrError: On the first such option.
    """
    for option, value in options.items():
        key = option.split('.')[0]  # clip_grad.max_norm=1 sets clip_grad
        if key in SETTING_SECTIONS:
            raise _misplaced(option, value, key=key)
        if key in OPTION_SETTINGS:
            raise _misplaced(option, value, OPTION_SETTINGS[key], key=key)


def _misplaced(given: str, value, sections=None, key=None) -> MmdtrError:
    """The error for ``given=value`` at the top level, where ``key`` (its
    first segment; ``given`` by default) is read only in ``sections``."""
    key = key or given
    sections = sections or (SETTING_SECTIONS[key], )
    places = ' or '.join(f'{section}.{key}' for section in sections)
    return MmdtrError(
        f'{given}={value!r} is a top-level key: mmdtr reads it only as '
        f'{places}, so it would be ignored.',
        hint=f'give it as {places} (--cfg-options {sections[0]}.{given}=...)'
        f', or, if it is a variable, use it in {" or ".join(sections)}.')
