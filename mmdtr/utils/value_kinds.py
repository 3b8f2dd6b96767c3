"""What kind of value a config gave: numbers read as numbers (NumPy's
too, a bool not), and list-like values read as their items (a string
whole, not as its characters)."""
import math
import numbers

import numpy as np


def is_integer(value) -> bool:
    """Whether ``value`` is an integer (NumPy's too), not a bool."""
    return isinstance(
        value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """Whether ``value`` is a real number (NumPy's too), not a bool."""
    return isinstance(value,
                      numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_finite_real(value) -> bool:
    """Whether ``value`` is a real number (:func:`is_real`) that is finite
    as a float: an int beyond any float is not (``math.isfinite`` raised
    ``OverflowError`` on it)."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def as_items(value) -> tuple:
    """The items of a list-like ``value`` (a list, a tuple, an array, a
    dict's keys), or ``()`` for a string (not read as its characters) and
    for a value that is not iterable (``None``, a number)."""
    if isinstance(value, (str, bytes)):
        return ()
    try:
        return tuple(value)
    except TypeError:
        return ()
