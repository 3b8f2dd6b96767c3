"""The backend switches a replay runs under (R4)."""
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
