"""Checks of the models' arguments: each names the key and the value.

Numbers are read as numbers: a NumPy scalar a config computed is accepted
where a Python number of its kind would be, and converted; a bool is not a
size, nor a string a number.
"""
import numpy as np

from mmdtr.errors import MmdtrError
from mmdtr.utils.value_kinds import as_items, is_integer, is_real

__all__ = [
    'as_items', 'is_integer', 'is_real', 'check_probability',
    'check_positive_int', 'check_positive_ints', 'check_probabilities',
    'check_bool'
]


def check_probability(owner: str, key: str, value) -> float:
    """Refuse a dropout probability that is not a number in [0, 1].

    Args:
        owner (str): The model's class name, for the message.
        key (str): The argument's name (``model.<key>`` in a config).
        value: The value given.

    Returns:
        float: The probability.

    Raises:
        MmdtrError: If ``value`` is not a number between 0 and 1.
    """
    if not is_real(value) or not 0 <= value <= 1:
        raise MmdtrError(
            f'{owner} {key} must be a probability between 0 and 1, got '
            f'{value!r}.',
            hint=f'set model.{key} to a float such as 0.1 (0 for none).')
    return float(value)


def check_positive_int(owner: str, key: str, value) -> int:
    """Refuse a size that is not a positive integer (``True`` included).

    Args:
        owner (str): The model's class name, for the message.
        key (str): The argument's name (``model.<key>`` in a config).
        value: The value given.

    Returns:
        int: The size.

    Raises:
        MmdtrError: If ``value`` is not an integer of 1 or more.
    """
    if not is_integer(value) or value < 1:
        raise MmdtrError(
            f'{owner} {key} must be a positive int, got {value!r}.',
            hint=f'set model.{key} to an int of 1 or more.')
    return int(value)


def check_positive_ints(owner: str, **values) -> list:
    """:func:`check_positive_int` of each keyword; the values in order.

    Examples:
        >>> in_channels, width = check_positive_ints(
        ...     'MyNet', in_channels=3, width=64)
    """
    return [check_positive_int(owner, k, v) for k, v in values.items()]


def check_probabilities(owner: str, **values) -> list:
    """:func:`check_probability` of each keyword; the values in order."""
    return [check_probability(owner, k, v) for k, v in values.items()]


def check_bool(key: str, value) -> bool:
    """Refuse a switch that is not ``True`` or ``False`` (or 0 or 1): a
    config's ``'False'`` is a true string.

    Args:
        key (str): The argument's key in a config
            (``model.zero_init_residual``).
        value: The value given.

    Returns:
        bool: The switch.

    Raises:
        MmdtrError: If ``value`` is neither a bool nor 0 or 1.
    """
    if not (isinstance(value, (bool, np.bool_))
            or is_integer(value) and value in (0, 1)):
        raise MmdtrError(
            f'{key} must be True or False, got {value!r}.',
            hint=f'set {key}=True or {key}=False.')
    return bool(value)
