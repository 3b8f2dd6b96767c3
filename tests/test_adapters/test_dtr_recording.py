"""DTRTrainStep's ``recording_threshold='auto'`` (the default; design.md
R16): after steps that evicted nothing, the next runs its ops as they are
until memory passes their highest peak (at most half the threshold).
"""
import copy
import uuid

import pytest
import torch
from mmengine.logging import MessageHub

from mmdtr.adapters.dtr_train_step import DTRTrainStep
from mmdtr.core.recording_threshold import AUTO_FRACTION
from .test_dtr_model_wrapper import DTRWrapperToyNet, _sgd, batch
from .test_dtr_training import assert_same_state

pytestmark = pytest.mark.usefixtures('single_thread')


def _hub():
    return MessageHub.get_instance(f'dtr_recording_{uuid.uuid4().hex}')


def _big_batch():
    """Four batches in one: about four times a batch's memory."""
    parts = [batch(i % 2) for i in range(4)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class GrowingToyNet(DTRWrapperToyNet):
    """Runs its batch ``rounds`` times in one: a step that grows with the
    same inputs (a path chosen per iteration, as SPOS does)."""
    rounds = 1

    def forward(self, inputs, labels=None, mode='tensor'):
        if labels is not None:
            labels = labels.repeat(self.rounds)
        return super().forward(
            inputs.repeat(self.rounds, 1, 1, 1), labels, mode=mode)


def _auto_steps(model, batches):
    """``model`` trained on ``batches`` under 'auto' with a threshold that
    a batch fits under the recording point and four batches do not fit,
    and a copy trained without DTR; the steps' statistics."""
    plain = copy.deepcopy(model)
    optim, plain_optim = _sgd(model), _sgd(plain)
    probe = DTRTrainStep(dict(eviction_threshold='1GB'), message_hub=_hub())
    probe(
        copy.deepcopy(model).train_step, batch(0), _sgd(copy.deepcopy(model)))
    peak = probe.stats.peak_memory
    threshold = int(peak * 2.5)
    assert peak <= threshold * AUTO_FRACTION
    hub = _hub()
    step = DTRTrainStep(
        dict(eviction_threshold=threshold, evictee_minimum_size=1),
        message_hub=hub)
    seen = []
    for data in batches:
        if callable(data):  # grow the model's step, then the batch
            data = data(model, plain)
        step(model.train_step, data, optim)
        plain.train_step(data, plain_optim)
        seen.append(step.stats)
    assert_same_state(plain, model)
    assert hub.get_scalar('train/dtr_idle_ops').current() == seen[-1].idle_ops
    return seen


def _rounds(n, data):

    def grow(*models):
        for m in models:
            m.rounds = n
        return data

    return grow


def test_auto_skips_recording_while_steps_fit_and_records_when_they_grow():
    seen = _auto_steps(GrowingToyNet(),
                       (batch(0), batch(1), batch(0), _rounds(4, batch(1)),
                        _rounds(1, batch(0)), _rounds(4, batch(1))))
    first, fits, fits_again, grown, after, grown_again = seen
    assert first.idle_ops == 0  # nothing known yet: recorded
    assert fits.idle_ops == fits.ops and fits_again.idle_ops == fits.ops
    # the grown step recorded from the recording point on, and evicted
    # what it recorded to hold the threshold
    assert 0 < grown.idle_ops < grown.ops and grown.evictions > 0
    # it evicted: the steps of the window after it record from the first
    # op, also the next large one (alternating sizes pay once)
    assert after.idle_ops == 0 and grown_again.idle_ops == 0


def test_auto_records_a_larger_batch_from_its_first_op():
    """A batch of more bytes than the recent ones records from its first
    op: what its first ops make may have to be evicted (R16)."""
    seen = _auto_steps(DTRWrapperToyNet(),
                       (batch(0), batch(1), batch(0), _big_batch(), batch(1)))
    first, fits, fits_again, larger, after = seen
    assert fits.idle_ops == fits.ops and fits_again.idle_ops == fits.ops
    assert larger.idle_ops == 0 and larger.evictions > 0
    assert after.idle_ops == 0  # it evicted: the window records


@pytest.mark.parametrize('recording_threshold', [None, 0])
def test_recording_from_the_first_op_when_asked(recording_threshold):
    model = DTRWrapperToyNet()
    optim = _sgd(model)
    step = DTRTrainStep(
        dict(
            eviction_threshold='1GB', recording_threshold=recording_threshold),
        message_hub=_hub())
    for i in range(3):
        step(model.train_step, batch(i % 2), optim)
        assert step.stats.idle_ops == 0 and step.stats.ops > 0


def test_a_size_records_from_that_size():
    model = DTRWrapperToyNet()
    optim = _sgd(model)
    step = DTRTrainStep(
        dict(eviction_threshold='1GB', recording_threshold='10KB'),
        message_hub=_hub())
    for i in range(2):
        step(model.train_step, batch(i), optim)
        assert 0 < step.stats.idle_ops < step.stats.ops


@pytest.mark.parametrize('recording_threshold', ['auto', None])
def test_a_batch_holding_a_sparse_tensor(recording_threshold):
    # its bytes are read for 'auto' only, counting it as dense (found by a
    # review: nbytes raised for sparse tensors, before the engine started)
    sparse = torch.sparse_coo_tensor([[0], [1]], [1.0], (4, 4))
    step = DTRTrainStep(
        dict(
            eviction_threshold='1GB', recording_threshold=recording_threshold),
        message_hub=_hub())
    seen = []
    for _ in range(2):
        step(lambda data, optim_wrapper: seen.append(data['adjacency']),
             dict(adjacency=sparse), _sgd(DTRWrapperToyNet()))
    assert seen == [sparse, sparse]
    assert step.recent.input_bytes[-1] == (64 if recording_threshold == 'auto'
                                           else None)
