"""Config files and ``--cfg-options`` of the tools, checked as they are read.

``tools/train.py``, ``tools/benchmark.py`` and ``tools/demo.py`` read a
config file and merge ``--cfg-options`` into it the same way, so a bad path
or a bad option gives the same one-line :class:`~mmdtr.errors.MmdtrError`
in each.
"""
import os.path as osp

from mmengine.config import Config, DictAction
from mmengine.utils import import_modules_from_strings

from mmdtr.adapters.config_translation import MEMORY_KEY_TRANSLATORS
from mmdtr.adapters.near_miss_keys import refuse_top_level_settings
from mmdtr.errors import MmdtrError

#: The config file types :meth:`mmengine.config.Config.fromfile` reads.
CONFIG_TYPES = ('.py', '.json', '.yaml', '.yml')


class CfgOptionsAction(DictAction):
    """:class:`~mmengine.config.DictAction` that rejects a missing ``=`` and
    a value it cannot parse (unbalanced brackets, ``dict(...)`` with a
    comma) with one :class:`~mmdtr.errors.MmdtrError` naming the pair."""

    def __call__(self, parser, namespace, values, option_string=None):
        for kv in values:
            if '=' not in kv:
                raise MmdtrError(
                    f'--cfg-options expects KEY=VALUE pairs, got {kv!r}.',
                    hint='e.g. --cfg-options train_cfg.max_iters=100 '
                    "optim_wrapper.optimizer.lr=0.01 'custom_imports."
                    "imports=[my_module]'")
        for kv in values:  # one by one: DictAction accumulates
            try:
                super().__call__(parser, namespace, [kv], option_string)
            except (RecursionError, AssertionError, ValueError, TypeError,
                    IndexError) as e:
                # MMEngine's parser recurses on a dict literal: its
                # RecursionError says nothing to a user
                why = '' if isinstance(e, RecursionError) else \
                    f' ({type(e).__name__}: {e})'
                raise MmdtrError(
                    f'--cfg-options {kv!r} cannot be parsed{why}. Accepted '
                    'values: a number, '
                    'a bool, None, a string, or a list or tuple of those in '
                    'balanced brackets ([a,b], (a,b)).',
                    hint='set nested keys one by one (dtr.eviction_'
                    'threshold=3GB), or write dicts in the config file.'
                ) from None


def read_config(path: str) -> Config:
    """Read the config file at ``path``.

    Args:
        path (str): Path of a ``.py``, ``.json``, ``.yaml`` or ``.yml`` file.

    Returns:
        Config: The config.

    Raises:
        MmdtrError: If ``path`` is not such a file.
    """
    if not osp.isfile(path):
        raise MmdtrError(
            f'config file {path!r} '
            f"{'is a directory' if osp.isdir(path) else 'does not exist'}.",
            hint='give the path of a config file, e.g. configs/demo_dtr.py.')
    if osp.splitext(path)[1] not in CONFIG_TYPES:
        raise MmdtrError(
            f'config file {path!r} is not of a type MMEngine reads; '
            f'accepted: {", ".join(CONFIG_TYPES)}.',
            hint='give the path of a config file, e.g. configs/demo_dtr.py.')
    return Config.fromfile(path)


def _list_key(key: str) -> str:
    """The dotted key of the list an index in ``key`` reaches into
    (``model.choices`` of ``model.choices.1``)."""
    parts = key.split('.')
    first = next(i for i, part in enumerate(parts) if part.isdigit())
    return '.'.join(parts[:first])


def merge_cfg_options(cfg: Config, options: dict) -> None:
    """Merge ``--cfg-options`` into ``cfg`` and import its custom_imports.

    MMEngine imports ``custom_imports`` only when it reads the config file,
    so imports given through ``--cfg-options`` are imported here.

    Args:
        cfg (Config): The config; changed in place.
        options (dict): The options, as :class:`CfgOptionsAction` parses
            them (dotted keys).

    Raises:
        MmdtrError: If an option does not follow the nesting of the config,
            or ``custom_imports`` is malformed or cannot be imported.
    """
    refuse_top_level_settings(options)
    for name in MEMORY_KEY_TRANSLATORS:
        # `dtr = None` in a file means off; `dtr.x=...` turns it on
        if name in cfg and cfg[name] is None and any(
                key.startswith(f'{name}.') for key in options):
            cfg[name] = {}
    try:
        cfg.merge_from_dict(options)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError) as e:
        indexed = [
            key for key in options
            if any(part.isdigit() for part in str(key).split('.'))
        ]
        raise MmdtrError(
            f'--cfg-options {options!r} cannot be merged into '
            f'{cfg.filename}: {e}',
            hint='a dotted key must follow the nesting of the config' +
            (f'; an index ({indexed[0]}) can reach only into a list of '
             "dicts (MMEngine's rule): give the whole list instead,"
             f' e.g. {_list_key(indexed[0])}=[a,b].'
             if indexed else '.')) from e
    if 'custom_imports' not in options and not any(
            key.startswith('custom_imports.') for key in options):
        return
    custom_imports = cfg.get('custom_imports')
    if not isinstance(custom_imports, dict) or 'imports' not in custom_imports:
        raise MmdtrError(
            f'custom_imports={custom_imports!r} is not accepted; expected '
            "dict(imports=['module', ...], allow_failed_imports=False).",
            hint="e.g. --cfg-options 'custom_imports.imports=[my_module]'.")
    try:
        import_modules_from_strings(**custom_imports)
    except ImportError as e:
        # MMEngine's error names the module; why is in the one it chains
        cause = e.__cause__ or e.__context__
        reason = f' ({type(cause).__name__}: {cause})' if cause else ''
        raise MmdtrError(
            f"custom_imports.imports={custom_imports['imports']!r} cannot be "
            f"imported: {str(e).rstrip('.')}{reason}.",
            hint='check the module names and PYTHONPATH.') from e
