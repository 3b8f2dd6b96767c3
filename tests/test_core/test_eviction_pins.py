"""What a backward node holds is never evicted (R3).

An unpack hands a backward node the engine's own alias of a resident saved
storage; the storage's use count then shows no other holder, yet the node
holds the alias until it is done. Evicting it freed nothing and counted an
eviction: an LSTM's backward at half its peak made 3 of its 8 evictions so
(an adversarial search of 2026-11-29), two of them after an op that read
it, one inside a rebuild another unpack of the node started.
"""
import pytest
import torch
import torch.nn as nn

from mmdtr.core import eviction


@pytest.fixture
def evictions_that_freed_nothing(monkeypatch):
    """The sizes of storages still alive after their eviction."""
    kept = []
    evict = eviction.Evictor._evict

    def checked(self, rec):
        evict(self, rec)
        if rec.cdata is not None:
            kept.append(rec.nbytes)

    monkeypatch.setattr(eviction.Evictor, '_evict', checked)
    return kept


def _lstm_step(model):
    out, _ = model(
        torch.randn(4, 20, 32, generator=torch.Generator().manual_seed(1)))
    loss = out.square().sum()
    loss.backward()
    return loss.detach()


def test_what_a_backward_node_holds_is_kept(oracle,
                                            evictions_that_freed_nothing):
    torch.manual_seed(0)
    check = oracle(nn.LSTM(32, 64, num_layers=2, batch_first=True), _lstm_step)
    stats = check.run(check.baseline_peak // 2)
    assert stats.evictions > 0
    assert evictions_that_freed_nothing == []
