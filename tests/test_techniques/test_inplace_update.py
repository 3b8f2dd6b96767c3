"""In-place optimizer steps and per-parameter steps in the backward.

The reference is a plain ``torch.optim`` optimizer stepping after the
backward; every comparison is bit for bit (``torch.equal``).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.optim.optimizer as torch_optimizer
from torch.utils.checkpoint import checkpoint

from mmdtr.errors import MmdtrError
from mmdtr.techniques.inplace_update import (PerParameterStepper, make_inplace,
                                             raw_step, release_grads)
from mmdtr.utils.profiler_memory import measure_peak_memory

OPTIMIZERS = {
    'sgd': (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    'sgd_nesterov':
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    'adamw': (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    'adam_amsgrad': (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
}


class TiedNet(nn.Module):
    """Embedding tied to the output layer, and a branch that gets no grad."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.unused = nn.Linear(6, 6)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens))).logsumexp(-1).mean()


def make_optimizer(model, name):
    cls, kwargs = OPTIMIZERS[name]
    groups = [
        dict(params=list(model.body.parameters()), lr=kwargs['lr'] / 2),
        dict(
            params=[model.embed.weight] + list(model.unused.parameters()),
            weight_decay=0.0),
    ]
    return cls(groups, **kwargs)


def tokens(i):
    return torch.randint(
        0, 10, (4, 5), generator=torch.Generator().manual_seed(i))


def train(name, in_backward, steps=4):
    torch.manual_seed(0)
    model = TiedNet()
    optimizer = make_optimizer(model, name)
    make_inplace(optimizer)
    stepper = PerParameterStepper(optimizer) if in_backward else None
    for i in range(steps):
        for group in optimizer.param_groups:  # a scheduler's lr change
            group['lr'] *= 0.9
        if stepper is None:
            model(tokens(i)).backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            stepper.begin()
            model(tokens(i)).backward()
            stepper.end()
            assert all(p.grad is None for p in model.parameters())
    return model, optimizer, stepper


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_step_in_backward_is_bit_identical(name):
    ref, ref_opt, _ = train(name, in_backward=False)
    model, opt, stepper = train(name, in_backward=True)
    for (key, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), key
    # the unused branch has no state, as with step()
    assert model.unused.weight not in opt.state
    # the tied weight stepped once per backward
    if 'step' in opt.state[model.embed.weight]:
        assert float(opt.state[model.embed.weight]['step']) == 4
    # the last backward stepped the 5 parameters with a gradient (the tied
    # one once)
    assert stepper.steps_taken == 5
    ref_state, state = ref_opt.state_dict(), opt.state_dict()
    assert ref_state['param_groups'] == state['param_groups']
    for k, v in ref_state['state'].items():
        for key, tensor in v.items():
            assert torch.equal(tensor, state['state'][k][key]), (k, key)


def test_unused_branch_keeps_its_initial_values():
    torch.manual_seed(0)
    init = TiedNet()
    model, _, _ = train('sgd', in_backward=True)
    assert torch.equal(model.unused.weight, init.unused.weight)
    assert not torch.equal(model.body[0].weight, init.body[0].weight)


def test_hooks_act_only_between_begin_and_end():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = PerParameterStepper(optimizer)
    before = copy.deepcopy(model)
    model(torch.ones(1, 3)).sum().backward()
    assert model.weight.grad is not None
    assert torch.equal(model.weight, before.weight)
    stepper.begin()
    model(torch.ones(1, 3)).sum().backward()
    stepper.end()
    assert not torch.equal(model.weight, before.weight)
    assert model.weight.grad is None
    stepper.remove()
    assert not model.weight._post_accumulate_grad_hooks


def test_per_parameter_steps_skip_step_hooks():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    stepper = PerParameterStepper(optimizer)
    stepper.begin()
    model(torch.ones(1, 3)).sum().backward()
    stepper.end()
    assert stepper.steps_taken == 2 and calls == []
    optimizer.step()  # no gradient left: only the hooks run
    assert calls == [1]
    assert raw_step(optimizer) is not type(optimizer).step


class _SubclassSGD(torch.optim.SGD):

    def step(self, closure=None):
        return super().step(closure)


def test_per_parameter_steps_skip_step_hooks_of_a_subclass():
    # super().step() reached SGD.step, hooked once any plain SGD was made,
    # which ran the optimizer's and the global step hooks once per
    # parameter (found by an adversarial search)
    model = nn.Linear(3, 2)
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # hooks SGD.step
    optimizer = _SubclassSGD(model.parameters(), lr=0.1)
    calls = []
    optimizer.register_step_pre_hook(lambda *args: calls.append('pre'))
    handle = torch_optimizer.register_optimizer_step_post_hook(
        lambda *args: calls.append('global post'))
    try:
        stepper = PerParameterStepper(optimizer)
        stepper.begin()
        model(torch.ones(1, 3)).sum().backward()
        stepper.end()
        assert stepper.steps_taken == 2 and calls == []
    finally:
        handle.remove()  # still removable: the hooks were put back
    assert not torch_optimizer._global_optimizer_post_hooks
    optimizer.step()
    assert calls.count('pre') >= 1


def test_clip_value_matches_clip_grad_value():
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    model = copy.deepcopy(ref)
    x = torch.randn(8, 4) * 10
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).square().sum().backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.5)
    ref_opt.step()
    stepper = PerParameterStepper(
        torch.optim.SGD(model.parameters(), lr=0.1), clip_value=0.5)
    stepper.begin()
    model(x).square().sum().backward()
    stepper.end()
    assert torch.equal(ref.weight, model.weight)
    assert torch.equal(ref.bias, model.bias)


def test_partial_gradient_is_refused():
    # reentrant checkpointing runs an inner backward per segment, so a
    # weight shared by two segments gets its gradient in two pieces
    shared = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(shared.parameters(), lr=0.1)
    stepper = PerParameterStepper(optimizer)
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(shared, x, use_reentrant=True)
    z = checkpoint(shared, y, use_reentrant=True)
    stepper.begin()
    with pytest.raises(MmdtrError, match='received its gradient twice'):
        z.sum().backward()


def test_lbfgs_is_refused():
    optimizer = torch.optim.LBFGS(nn.Linear(2, 2).parameters())
    with pytest.raises(MmdtrError, match='LBFGS'):
        PerParameterStepper(optimizer)


def test_make_inplace_sets_foreach_false_and_keeps_fused():
    params = list(nn.Linear(3, 3).parameters())
    optimizer = torch.optim.AdamW(params, lr=0.1)
    make_inplace(optimizer)
    assert optimizer.defaults['foreach'] is False
    assert all(g['foreach'] is False for g in optimizer.param_groups)
    fused = torch.optim.AdamW(params, lr=0.1, fused=True)
    make_inplace(fused)
    assert fused.param_groups[0]['fused'] is True
    with pytest.raises(MmdtrError, match='foreach=True'):
        make_inplace(torch.optim.SGD(params, lr=0.1, foreach=True))


def test_release_grads():
    model = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    release_grads(optimizer)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize('name', ['sgd', 'adamw'])
def test_inplace_step_allocates_no_copy_of_the_parameter_list(name):
    """A foreach step allocates copies of the whole list; the loop does not."""
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    peaks = {}
    for foreach in (True, False):
        optimizer = cls(model.parameters(), foreach=foreach, **kwargs)
        if not foreach:
            make_inplace(optimizer)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # allocate the state outside the measurement
        _, peaks[foreach] = measure_peak_memory(optimizer.step)
    print(f'{name} step peak: foreach {peaks[True]} B, in place '
          f'{peaks[False]} B; parameters {param_bytes} B')
    # the loop's temporaries are one parameter's (AdamW: sqrt and division
    # of the second moment, two at once), never the whole list's
    assert peaks[False] <= 2 * largest + 4096
    assert peaks[True] - peaks[False] >= 0.6 * param_bytes


def test_non_reentrant_checkpointing_of_a_shared_weight():
    """Non-reentrant recomputation stays inside the outer backward."""
    results = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        shared = nn.Linear(4, 4)
        optimizer = torch.optim.SGD(shared.parameters(), lr=0.1, momentum=0.9)
        stepper = PerParameterStepper(optimizer) if in_backward else None
        for i in range(3):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
            y = checkpoint(shared, x, use_reentrant=False).tanh()
            z = checkpoint(shared, y, use_reentrant=False)
            if stepper is None:
                z.square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            else:
                stepper.begin()
                z.square().sum().backward()
                stepper.end()
                assert stepper.steps_taken == 2
        results.append(shared)
    assert torch.equal(results[0].weight, results[1].weight)
    assert torch.equal(results[0].bias, results[1].bias)


def test_a_backward_that_raises_leaves_the_optimizer_as_it_was():
    # some parameters stepped, then the backward raised: the groups, the
    # step hooks (emptied during each step) and the hooks' state are back,
    # and gradients accumulate as usual afterwards
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # hooks SGD.step
    optimizer = _SubclassSGD(model.parameters(), lr=0.1, momentum=0.9)
    groups, params = optimizer.param_groups, list(model.parameters())
    optimizer.register_step_pre_hook(lambda *args: None)
    stepper = PerParameterStepper(optimizer)

    def fail(grad):
        raise RuntimeError('a hook failed')

    h = model[0](torch.ones(5, 3))
    h.register_hook(fail)  # after the last layer's parameters stepped
    stepper.begin()
    with pytest.raises(RuntimeError, match='a hook failed'):
        model[2](torch.tanh(h)).sum().backward()
    stepper.end()
    assert stepper.steps_taken == 2  # the last layer's weight and bias
    assert optimizer.param_groups is groups
    assert groups[0]['params'] == params
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    model.zero_grad()
    model(torch.ones(5, 3)).sum().backward()  # not stepped: accumulates
    assert all(p.grad is not None for p in model.parameters())


class _StopGradientRead(nn.Module):
    """Reads the head's weight a second time without gradient (an auxiliary
    loss with a frozen copy of the head), before its own use."""

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.body(x)
        weight = self.head.weight
        frozen = weight.detach() if self.read == 'detach' else weight.data
        aux = nn.functional.linear(h, frozen).square().mean()
        return self.head(h.relu()).square().mean() + aux


class _OneStopGradientRead(nn.Module):
    """Reads ``w`` once without gradient, through one view of its storage
    (``_StopGradientRead`` makes two), before its own use."""

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.a, self.w = nn.Parameter(torch.randn(4)), nn.Parameter(
            torch.randn(4))

    def forward(self, x):
        h = x * self.a
        frozen = self.w.detach() if self.read == 'detach' else self.w.data
        aux = (h * frozen).sum()
        return (h * self.w).square().sum() + aux


@pytest.mark.parametrize('model_cls',
                         [_StopGradientRead, _OneStopGradientRead])
@pytest.mark.parametrize('read', ['detach', 'data'])
def test_parameter_read_without_gradient_steps_after_the_backward(
        model_cls, read):
    # autograd orders a parameter's hook after the nodes that give it a
    # gradient only: the stop-gradient read ran after the step, on the new
    # weight (.detach(): autograd's in-place error; .data: other gradients,
    # silently; found by a review). Such a parameter steps at the end. One
    # view of its storage is a use of its own, not the parameter's (found
    # by mutation testing: counted as the parameter's, w stepped early)
    results = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = model_cls(read)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        stepper = PerParameterStepper(optimizer) if in_backward else None
        for i in range(3):
            loss = model(
                torch.randn(8, 4, generator=torch.Generator().manual_seed(i)))
            if stepper is None:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            else:
                stepper.begin()
                loss.backward()
                stepper.end()
                assert stepper.steps_taken == len(list(model.parameters()))
                assert all(p.grad is None for p in model.parameters())
        results.append(model)
    for (name, p), q in zip(results[0].named_parameters(),
                            results[1].parameters()):
        assert torch.equal(p, q), name


def test_deferred_parameters_do_not_step_after_a_failed_backward():
    model = _StopGradientRead('detach')
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    stepper = PerParameterStepper(optimizer)
    before = model.head.weight.detach().clone()

    def fail(grad):
        raise RuntimeError('a hook failed')

    loss = model(torch.ones(2, 4))
    model.body.weight.register_hook(fail)
    stepper.begin()
    with pytest.raises(RuntimeError, match='a hook failed'):
        loss.backward()
    stepper.end(completed=False)
    assert torch.equal(model.head.weight, before)


def test_a_parameter_listed_twice_steps_once_in_backward():
    # documented: twice per optimizer.step() (torch warns), once with the
    # per-parameter steps
    moved = []
    for in_backward in (False, True):
        weight = nn.Parameter(torch.zeros(1))
        with pytest.warns(UserWarning, match='duplicate parameters'):
            optimizer = torch.optim.SGD([weight, weight], lr=1.0)
        make_inplace(optimizer)
        stepper = PerParameterStepper(optimizer) if in_backward else None
        if stepper is not None:
            stepper.begin()
        (weight * -1.0).sum().backward()
        if stepper is not None:
            stepper.end()
        else:
            optimizer.step()
        moved.append(weight.item())
    assert moved == [2.0, 1.0]
