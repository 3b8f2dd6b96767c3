"""DTRTrainStep: the engine of one training step, closed after backward
(after the step where the model holds a context of its own around it),
an instance's own backward kept, misuse refused."""
import copy
import uuid

import pytest
import torch
from mmengine.logging import MessageHub
from mmengine.optim import OptimWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from mmdtr.adapters.dtr_train_step import DTRTrainStep
from mmdtr.core.torch_compat import outer_saved_tensor_hooks
from mmdtr.dtr import DTR, engine_active
from mmdtr.errors import MmdtrError
from .test_dtr_model_wrapper import DTR_CFG, DTRWrapperToyNet, _sgd, batch

pytestmark = pytest.mark.usefixtures('single_thread')


def test_train_step_closes_the_engine_after_backward():
    model = DTRWrapperToyNet()
    optim = _sgd(model, accumulative_counts=2)
    optim.initialize_count_status(model, 0, 4)
    at_step = []
    optim.optimizer.register_step_pre_hook(
        lambda *a: at_step.append(engine_active()))
    hub = MessageHub.get_instance(f'dtr_step_{uuid.uuid4().hex}')
    step = DTRTrainStep(DTR_CFG, message_hub=hub)
    for i in range(2):  # the first only accumulates, the second steps
        step(model.train_step, batch(i), optim)
        assert torch._C._len_torch_dispatch_stack() == 0
        assert 'backward' not in vars(optim)
        assert step.stats.evictions > 0
    assert at_step == [False]
    assert model.dtr_seen == [('loss', True)] * 2
    assert len(hub.get_scalar('train/dtr_evictions').data[0]) == 2


class _PassThrough(TorchDispatchMode):

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('context', ['save_on_cpu', 'mode'])
def test_a_context_the_model_enters_around_its_step_closes_after_it(context):
    # the engine closed inside update_params, under the model's context:
    # refused (a saved_tensors_hooks context; found by a review) or
    # raising (a dispatch mode entered after the engine); it closes after
    # the step instead, with the plain step's parameters
    model = DTRWrapperToyNet()
    plain = copy.deepcopy(model)

    def enter():
        if context == 'save_on_cpu':
            return torch.autograd.graph.save_on_cpu()
        return _PassThrough()

    def train_step(net, optim):

        def run(data, optim_wrapper):
            with enter():
                loss = net(**data, mode='loss')['loss']
                optim_wrapper.update_params(loss)
            return dict(loss=loss.detach())

        return run

    optim, plain_optim = _sgd(model), _sgd(plain)
    step = DTRTrainStep(
        dict(DTR_CFG, recording_threshold=None),
        message_hub=MessageHub.get_instance(f'dtr_{uuid.uuid4().hex}'))
    for i in range(2):
        step(train_step(model, optim), batch(i), optim)
        train_step(plain, plain_optim)(batch(i), plain_optim)
        assert torch._C._len_torch_dispatch_stack() == 0
    assert outer_saved_tensor_hooks() is None
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_train_step_keeps_an_instance_backward_and_refuses_misuse():
    model = DTRWrapperToyNet()
    optim = _sgd(model)
    calls = []

    def backward(loss, **kwargs):
        calls.append(engine_active())
        OptimWrapper.backward(optim, loss, **kwargs)

    optim.backward = backward
    step = DTRTrainStep(DTR_CFG, message_hub=MessageHub.get_instance('x'))
    step(model.train_step, batch(0), optim)
    assert calls == [True] and optim.backward is backward
    with pytest.raises(MmdtrError, match='got SGD'):
        step(model.train_step, batch(0), optim.optimizer)
    with DTR(eviction_threshold='1GB'):  # never two engines nested
        with pytest.raises(MmdtrError, match='already active'):
            step(model.train_step, batch(0), optim)
    assert torch._C._len_torch_dispatch_stack() == 0
