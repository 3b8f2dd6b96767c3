"""Parse memory sizes given as ints or strings such as ``'5GB'``."""
import numbers
import re
from fractions import Fraction
from typing import Optional, Union

from mmdtr.errors import MmdtrError

# Binary units throughout, as MegEngine reads them ('1GB' == 2**30).
_UNITS = {'': 1, 'b': 1}
for _i, _p in enumerate('kmgt', start=1):
    _UNITS[_p + 'b'] = _UNITS[_p + 'ib'] = 1024**_i
_PATTERN = re.compile(r'^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$')
#: longer strings are refused before the pattern: it backtracks
#: quadratically on a long run of digits (4 s for 10,000), and Fraction
#: refuses more than 4,300 digits with a raw ValueError (an adversarial
#: search)
_MAX_CHARS = 1000
#: what an error shows of a longer string
_SHOWN_CHARS = 64
ACCEPTED = ("an int number of bytes, or a string like '5GB', '512MiB', "
            "'1.5 GB' (B, KB/KiB, MB/MiB, GB/GiB, TB/TiB; all binary, "
            "1GB = 2**30 bytes, in any case, as MegEngine reads them: "
            "'5gb' and '5Gb' are bytes, not bits)")


def parse_size(value: Union[int, str, None],
               key: str = 'size',
               allow_none: bool = False) -> Optional[int]:
    """Return ``value`` as a number of bytes.

    Args:
        value (int | str | None): Bytes as an int, or a string such as
            ``'5GB'``, ``'512MiB'`` or ``'1.5 GB'``. Units are binary
            (``'1GB' == 2**30``), as in MegEngine.
        key (str): The name of the option, used in error messages.
        allow_none (bool): Whether ``None`` (meaning "unset") is accepted.

    Returns:
        int | None: The number of bytes.

    Raises:
        MmdtrError: If the value is of another type or form, negative, or
            a string naming more than 0 but less than 1 byte.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        pass  # bool is an int subclass; reject it below
    elif isinstance(value, numbers.Integral):  # numpy's ints too
        if value < 0:
            raise MmdtrError(f'{key}={_shown(value)} is negative.',
                             f'Give {ACCEPTED}.')
        return int(value)
    elif isinstance(value, str) and len(value) <= _MAX_CHARS:
        match = _PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS:
            # exact: no float overflow on long digit strings, no rounding
            exact = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
            if 0 < exact < 1:
                raise MmdtrError(
                    f'{key}={_shown(value)} is less than one byte.',
                    f'Give {ACCEPTED}; 0 means "no threshold" where a '
                    'threshold may be left out.')
            return int(exact)  # fractions of a byte are dropped
    raise MmdtrError(f'{key}={_shown(value)} is not a size.',
                     f'Give {ACCEPTED}.')


def _shown(value) -> str:
    """``value`` as an error names it: a long string cut short, a huge int
    by its bits (Python prints no int of more than 4,300 digits)."""
    if isinstance(value, str) and len(value) > _SHOWN_CHARS:
        return f'{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)'
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        bits = abs(int(value)).bit_length()
        if bits > 256:
            return f'{"-" if value < 0 else ""}(an int of {bits} bits)'
    return repr(value)


def format_size(nbytes: float) -> str:
    """Format bytes for humans, e.g. ``'1.50 GiB'``."""
    for unit, scale in (('GiB', 1024**3), ('MiB', 1024**2), ('KiB', 1024)):
        if abs(nbytes) >= scale:
            return f'{nbytes / scale:.2f} {unit}'
    return f'{int(nbytes)} B'
