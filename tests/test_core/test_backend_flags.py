"""The backend switches a replay runs under (R4)."""
import pytest
import torch

from mmdtr.core.backend_flags import current, switched_to


def test_switched_to_sets_what_differs_and_puts_it_back():
    before = current()
    with torch.backends.mkldnn.flags(enabled=False):
        torch.use_deterministic_algorithms(True)
        try:
            recorded = current()
        finally:
            torch.use_deterministic_algorithms(False)
    assert recorded != before
    with switched_to(recorded):
        assert current() == recorded
        assert not torch.backends.mkldnn.is_available() or \
            not torch.backends.mkldnn.enabled
        assert torch.are_deterministic_algorithms_enabled()
    assert current() == before
    with switched_to(before):  # nothing to change
        assert current() == before


def test_switched_to_puts_back_after_an_exception():
    before = current()
    recorded = (not before[0], not before[1]) + before[2:]  # both bools
    try:
        with switched_to(recorded):
            assert current() == recorded
            raise KeyError('in the replay')
    except KeyError:
        pass
    assert current() == before


def _flushing(one=1.0):
    return 5e-324 * one == 0.0  # a subnormal times one: zero when flushed


@pytest.mark.skipif(
    not torch.set_flush_denormal(False), reason='no flush-to-zero here')
def test_switched_to_covers_flush_to_zero_and_per_backend_precision():
    get = getattr(torch._C, '_get_fp32_precision_getter', None)
    put = getattr(torch._C, '_set_fp32_precision_setter', None)
    before = current()
    saved = get('mkldnn', 'matmul') if get else None
    try:
        torch.set_flush_denormal(True)
        if get:  # the legacy getter raises now: recording still works
            torch.backends.mkldnn.matmul.fp32_precision = 'tf32'
        recorded = current()
    finally:
        torch.set_flush_denormal(False)
        if get:
            put('mkldnn', 'matmul', saved)
    assert current() == before and not _flushing()
    with switched_to(recorded):
        assert _flushing()
        assert get is None or get('mkldnn', 'matmul') == 'tf32'
    assert current() == before and not _flushing()
