"""A config the runner can write, checked before the work dir is made.

MMEngine's Runner writes its config to the log and the work dir as Python
source (``Config.pretty_text``), after it has made the work dir. A value
without a source form (an object such as an eviction policy instance, a
class imported at the top of a config file, a model built in Python) fails
there, in yapf's raw ``SyntaxError``, once the work dir exists; mmdtr's
checks had accepted it (found by an adversarial search).
"""
import ast
from collections.abc import Mapping

from mmdtr.errors import MmdtrError

_LITERALS = (str, int, float, bool, type(None))


def refuse_unwritable(cfg) -> None:
    """Refuse ``cfg`` if MMEngine cannot write it as Python source.

    Args:
        cfg (Config): The config a runner is about to be built from.

    Raises:
        MmdtrError: Naming the first value without a source form, if
            ``cfg.pretty_text`` fails.

    Examples:
        >>> refuse_unwritable(Config(dict(dtr=dict(policy='lru'))))  # fine
        >>> refuse_unwritable(Config(dict(dtr=dict(policy=LRUPolicy()))))
        MmdtrError: mmdtr: dtr.policy=<...LRUPolicy object at ...> cannot
        be written to the work dir: ...
    """
    try:
        cfg.pretty_text
    except Exception as error:  # noqa: B902 - yapf's SyntaxError, or other
        found = _without_source({key: cfg[key] for key in cfg.keys()}, '')
        path, value = found if found else ('the config', None)
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + '...'
        what = f'{path}={text}' if found else 'the config'
        if path.endswith('policy'):
            hint = ('give the policy by name: register its class with '
                    'mmdtr.dtr.register_policy in a module the config '
                    "imports (custom_imports), and write policy='<name>'.")
        else:
            hint = ("give it as a dict with a registered type name "
                    "(type='...'); a name a config file binds to a class "
                    'or object stays in it as a key: `del` it at the end '
                    'of the file.')
        raise MmdtrError(
            f'{what} cannot be written to the work dir: MMEngine\'s Runner '
            'writes the config there as Python source, and this value has '
            f'none (it would fail with {type(error).__name__} after making '
            'the work dir).',
            hint=hint) from None


def _without_source(value, path: str):
    """``(path, value)`` of the first value in ``value`` whose ``repr`` is no
    Python expression, or ``None``."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _without_source(item, f'{path}.{key}' if path else key)
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _without_source(item, f'{path}[{i}]')
            if found:
                return found
        return None
    if isinstance(value, _LITERALS) or type(value).__name__.startswith(
            'Lazy'):  # new-style configs' imports: MMEngine writes those
        return None
    try:
        ast.parse(repr(value), mode='eval')
    except SyntaxError:
        return path, value
    return None
