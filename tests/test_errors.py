"""mmdtr's one error type."""
import copy
import pickle

import pytest

from mmdtr.errors import MmdtrError


def test_message_prefix_and_hint():
    error = MmdtrError(
        "dtr.eviction_threshold='3XB' is not a size.", hint="e.g. '3GB'.")
    assert str(error) == ("mmdtr: dtr.eviction_threshold='3XB' is not a "
                          "size. Hint: e.g. '3GB'.")
    assert error.message.startswith('dtr.') and error.hint == "e.g. '3GB'."
    assert isinstance(error, ValueError)
    assert str(MmdtrError('no hint.')) == 'mmdtr: no hint.'


@pytest.mark.parametrize(
    'copier',
    [copy.copy, copy.deepcopy, lambda e: pickle.loads(pickle.dumps(e))])
def test_copies_keep_one_prefix_and_the_hint(copier):
    # an unpickled error (from a benchmark worker or another rank) read
    # "mmdtr: mmdtr: ..."
    error = MmdtrError('bad value.', hint='give a good one.')
    error.note = 'kept'
    other = copier(error)
    assert str(other) == str(error) and other.hint == error.hint
    assert other.message == 'bad value.' and other.note == 'kept'
