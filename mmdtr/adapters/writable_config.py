"""A config the runner can write, checked before the work dir is made.

MMEngine's Runner writes its config to the log and the work dir as Python
source (``Config.pretty_text``), after it has made the work dir. A value
without a source form (an object such as an eviction policy instance, a
class imported at the top of a config file, a model built in Python) fails
there, in yapf's raw ``SyntaxError``, once the work dir exists; mmdtr's
checks had accepted it (found by an adversarial search).
"""
import ast
import keyword
from collections.abc import Mapping

from mmdtr.core.policies import EvictionPolicy
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
        found = _without_source(_values(cfg), '')
        path, value, bad_key = found or ('the config', None, False)
        text = ' '.join(str(value).split())  # as written, on one line
        text = text if len(text) <= 80 else text[:77] + '...'
        what = f'{path}={text}' if found else 'the config'
        why = 'its key is a Python keyword, which dict(...) cannot take' \
            if bad_key else 'this value has none'
        if bad_key:
            hint = 'rename the key.'
        elif _is_policy(value):
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
            f'writes the config there as Python source, and {why} (it would '
            f'fail with {type(error).__name__} after making the work dir).',
            hint=hint) from None


def _values(cfg) -> dict:
    """The config's values as MMEngine writes them: a new-style config's
    imports as ``LazyObject``, not the classes its keys give when read (a
    review)."""
    if getattr(cfg, '_imported_names', None) and hasattr(
            cfg, '_to_lazy_dict'):  # a new-style config (lazy imports)
        return cfg._to_lazy_dict()
    return {key: cfg[key] for key in cfg.keys()}


def _is_policy(value) -> bool:
    """Whether ``value`` is an eviction policy or its class (the hint to
    register it by name applies; another ``policy`` key's value, a
    hook's ``lr_policy``, is not; a review)."""
    if isinstance(value, type):
        return issubclass(value, EvictionPolicy)
    return isinstance(value, EvictionPolicy)


def _without_source(value, path: str):
    """``(path, value, whether the key is at fault)`` of the first value in
    ``value`` that MMEngine cannot write as Python source, or ``None``: one
    whose ``str`` (``repr`` for strings, which this skips) is no Python
    expression, or one under a key that is a Python keyword (written
    ``dict(from=...)``)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            here = f'{path}.{key}' if path else str(key)
            if isinstance(key, str) and keyword.iskeyword(key):
                return here, item, True
            found = _without_source(item, here)
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
        ast.parse(str(value), mode='eval')
    except SyntaxError:
        return path, value, False
    return None
