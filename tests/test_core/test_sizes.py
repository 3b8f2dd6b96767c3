"""Sizes given as ints or strings (mmdtr/core/sizes.py)."""
import numpy as np
import pytest

from mmdtr.core.sizes import format_size, parse_size
from mmdtr.errors import MmdtrError


@pytest.mark.parametrize(
    'value, nbytes',
    [
        (0, 0),
        (123, 123),
        ('5GB', 5 * 2**30),
        ('512MiB', 512 * 2**20),
        ('1.5 GB', 3 * 2**29),
        (' 5gb ', 5 * 2**30),
        ('3Gb', 3 * 2**30),  # any case, as MegEngine: bytes, not bits
        ('0.3MB', 314572),  # fractions of a byte are dropped
        ('0', 0),
        ('9' * 400 + 'GB', int('9' * 400) * 2**30),  # exact, no float overflow
        (np.int64(2**20), 2**20),  # a size computed with numpy
    ])
def test_accepted_sizes(value, nbytes):
    parsed = parse_size(value, 'eviction_threshold')
    assert parsed == nbytes and type(parsed) is int


@pytest.mark.parametrize('value, match', [
    ('0.5B', 'less than one byte'),
    ('0.9', 'less than one byte'),
    (-1, 'negative'),
    (True, 'is not a size'),
    (np.True_, 'is not a size'),
    (np.int64(-1), 'negative'),
    (1.5, 'is not a size'),
    ('1e3MB', 'is not a size'),
    ('5 XB', 'is not a size'),
    ('-1GB', 'is not a size'),
    ('', 'is not a size'),
])
def test_rejected_sizes_name_the_key_and_value(value, match):
    with pytest.raises(MmdtrError, match=match) as info:
        parse_size(value, 'eviction_threshold')
    assert f'eviction_threshold={value!r}' in str(info.value)
    assert 'Hint:' in str(info.value)


def test_format_size():
    assert format_size(3 * 2**29) == '1.50 GiB'
    assert format_size(512) == '512 B'


@pytest.mark.parametrize(
    'value, shown', [
        ('1' * 5000 + 'GB', "'1111"),
        ('1' * 10000 + '!', '(10001 characters)'),
        (-10**5000, '-(an int of 16610 bits)'),
    ],
    ids=['digits', 'digits_then_a_sign', 'huge_int'])
def test_huge_values_are_refused_at_once_with_a_short_message(value, shown):
    # Python's raw "Exceeds the limit (4300 digits)", and a pattern that
    # took 4 s on 10,000 digits (found by an adversarial search)
    with pytest.raises(MmdtrError, match='is (not a size|negative)') as info:
        parse_size(value, 'eviction_threshold')
    assert shown in str(info.value) and len(str(info.value)) < 800
