"""Checks of single config values and of the keys of a config dict, with
errors that name the key, the value and what is accepted (shared by the
optimizer wrapper's settings and the runner's config checks)."""
import difflib
import inspect
import math
from typing import Iterable, Optional

from mmdtr.errors import MmdtrError
from mmdtr.utils.value_kinds import is_real


def argument_names(func, skip: int) -> list:
    """The names of ``func``'s parameters after the first ``skip``."""
    return list(inspect.signature(func).parameters)[skip:]


def check_positive(value, key: str, hint: str) -> None:
    """Refuse ``value`` of ``key`` unless it is a positive finite number
    (bools refused), with ``hint``."""
    if not (is_real(value) and 0 < value < math.inf):  # nan: False
        raise MmdtrError(
            f'{key}={value!r} is not accepted; expected a positive finite '
            'number.',
            hint=hint)


def refuse_non_bool(value, key: str, allow_none: bool = False) -> None:
    """Refuse ``value`` of ``key`` unless it is a bool (or None, where
    ``allow_none``)."""
    if not (isinstance(value, bool) or allow_none and value is None):
        accepted = f'{"None, " if allow_none else ""}True or False'
        raise MmdtrError(
            f'{key}={value!r} is not accepted; accepted: {accepted}.',
            hint=f'write {key.rsplit(".", 1)[-1]}=True or False (a bool, '
            'not a string or a number).')


def check_keys(names: Iterable,
               accepted: Iterable[str],
               key: str,
               what: str,
               values: Optional[dict] = None,
               example: str = '') -> None:
    """Refuse names that are not in ``accepted``, with the closest matches.

    Args:
        names (Iterable): The names given.
        accepted (Iterable[str]): The accepted names.
        key (str): The config key the names are under, for messages.
        what (str): What the accepted names are, for messages.
        values (dict, optional): The values of the names, for messages.
        example (str): An example of accepted settings, for the hint.

    Raises:
        MmdtrError: If a name is not accepted.
    """
    accepted = list(accepted)
    unknown = sorted((n for n in names if n not in accepted), key=repr)
    if not unknown:
        return
    given = ', '.join(f'{key}.{n}' + (f'={values[n]!r}' if values else '')
                      for n in unknown)
    close = {
        n: difflib.get_close_matches(str(n), accepted, n=1)
        for n in unknown
    }
    renames = [f'{n} to {c[0]}' for n, c in close.items() if c]
    raise MmdtrError(
        f'{given} {"is" if len(unknown) == 1 else "are"} not accepted: not '
        f'{what}; accepted: {", ".join(accepted)}.',
        hint=(f'rename {", ".join(renames)}'
              if renames else f'remove {", ".join(map(str, unknown))}') +
        (f'; {example}.' if example else '.'))
