"""Checks of the models' arguments: each names the key and the value."""
from mmdtr.errors import MmdtrError


def check_probability(owner: str, key: str, value) -> None:
    """Refuse a dropout probability that is not a number in [0, 1].

    Args:
        owner (str): The model's class name, for the message.
        key (str): The argument's name (``model.<key>`` in a config).
        value: The value given.

    Raises:
        MmdtrError: If ``value`` is not an int or float between 0 and 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= 1:
        raise MmdtrError(
            f'{owner} {key} must be a probability between 0 and 1, got '
            f'{value!r}.',
            hint=f'set model.{key} to a float such as 0.1 (0 for none).')


def check_positive_int(owner: str, key: str, value) -> None:
    """Refuse a size that is not a positive int (``True`` included).

    Args:
        owner (str): The model's class name, for the message.
        key (str): The argument's name (``model.<key>`` in a config).
        value: The value given.

    Raises:
        MmdtrError: If ``value`` is not an int of 1 or more.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MmdtrError(
            f'{owner} {key} must be a positive int, got {value!r}.',
            hint=f'set model.{key} to an int of 1 or more.')


def check_bool(key: str, value) -> None:
    """Refuse a switch that is not ``True`` or ``False`` (a config's
    ``'False'`` is a true string).

    Args:
        key (str): The argument's key in a config
            (``model.zero_init_residual``).
        value: The value given.

    Raises:
        MmdtrError: If ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise MmdtrError(
            f'{key} must be True or False, got {value!r}.',
            hint=f'set {key}=True or {key}=False.')
