"""InplaceOptimWrapper against MMEngine's OptimWrapper, bit for bit.

Every run starts from the same weights and data; parameters (and optimizer
state where stated) must be ``torch.equal`` after several steps. Memory is
measured with the profiler's allocation events (``measure_peak_memory``).
"""
import copy

import pytest
import torch
import torch.nn as nn
from mmengine.optim import OptimWrapper
from mmengine.optim.scheduler import LinearLR

from mmdtr.adapters.inplace_optim_wrapper import InplaceOptimWrapper
from mmdtr.errors import MmdtrError
from mmdtr.utils.profiler_memory import measure_peak_memory

OPTIMIZERS = {
    'sgd': (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
    'adamw': (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


class TiedNet(nn.Module):
    """Tied embedding/output weight, BatchNorm, and an unused branch."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Sequential(
            nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.unused = nn.Linear(8, 8)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens))).logsumexp(-1).mean()


def tokens(i):
    return torch.randint(
        0, 16, (6, ), generator=torch.Generator().manual_seed(i))


def build(wrapper_cls, name='sgd', lr_groups=True, **wrapper_kwargs):
    torch.manual_seed(0)
    model = TiedNet()
    cls, kwargs = OPTIMIZERS[name]
    params = [
        dict(params=list(model.body.parameters()), lr=kwargs['lr'] / 2),
        dict(params=[model.embed.weight] + list(model.unused.parameters()))
    ] if lr_groups else model.parameters()
    wrapper = wrapper_cls(optimizer=cls(params, **kwargs), **wrapper_kwargs)
    return model, wrapper


def train(model, wrapper, iters, start=0, scheduler=None):
    for i in range(start, start + iters):
        with wrapper.optim_context(model):
            loss = model(tokens(i))
        wrapper.update_params(loss)
        if scheduler is not None:
            scheduler.step()
    return model


def assert_same_params(model_a, model_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), f'parameter {name} differs'
    for (name, a), b in zip(model_a.named_buffers(), model_b.buffers()):
        assert torch.equal(a, b), f'buffer {name} differs'


def assert_same_state(wrapper_a, wrapper_b):
    state_a, state_b = wrapper_a.state_dict(), wrapper_b.state_dict()
    assert state_a['state'].keys() == state_b['state'].keys()
    for key, entries in state_a['state'].items():
        for name, value in entries.items():
            assert torch.equal(value, state_b['state'][key][name]), name


@pytest.mark.parametrize('step_in_backward', [False, True])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_bit_identical_to_optim_wrapper(name, step_in_backward):
    ref, ref_wrapper = build(OptimWrapper, name)
    model, wrapper = build(
        InplaceOptimWrapper, name, step_in_backward=step_in_backward)
    # a warm-up scheduler changes every group's lr at every iteration
    train(ref, ref_wrapper, 5, scheduler=LinearLR(ref_wrapper, 0.1, end=4))
    train(model, wrapper, 5, scheduler=LinearLR(wrapper, 0.1, end=4))
    assert_same_params(ref, model)
    assert_same_state(ref_wrapper, wrapper)
    assert model.unused.weight.grad is None
    assert all(p.grad is None for p in model.parameters())
    assert wrapper.optimizer.param_groups[0]['foreach'] is False


def test_accumulation_and_norm_clipping_match():
    kwargs = dict(accumulative_counts=3, clip_grad=dict(max_norm=0.05))
    ref, ref_wrapper = build(OptimWrapper, 'adamw', **kwargs)
    model, wrapper = build(InplaceOptimWrapper, 'adamw', **kwargs)
    for m, w in ((ref, ref_wrapper), (model, wrapper)):
        w.initialize_count_status(m, 0, 7)  # 3 + 3 + a remainder of 1
        train(m, w, 7)
    assert_same_params(ref, model)
    assert_same_state(ref_wrapper, wrapper)


def test_value_clipping_in_backward_matches():
    clip = dict(type='value', clip_value=0.01)
    ref, ref_wrapper = build(OptimWrapper, 'sgd', clip_grad=dict(clip))
    model, wrapper = build(
        InplaceOptimWrapper, 'sgd', clip_grad=clip, step_in_backward=True)
    train(ref, ref_wrapper, 3)
    train(model, wrapper, 3)
    assert_same_params(ref, model)
    assert clip == dict(type='value', clip_value=0.01)  # config untouched


@pytest.mark.parametrize('step_in_backward', [False, True])
def test_grads_are_none_after_step(step_in_backward):
    model, wrapper = build(
        InplaceOptimWrapper, step_in_backward=step_in_backward)
    wrapper.backward(model(tokens(0)))
    has_grad = [p.grad is not None for p in model.parameters()]
    assert any(has_grad) != step_in_backward
    wrapper.step()  # no zero_grad
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize('step_in_backward', [False, True])
@pytest.mark.parametrize('source', [OptimWrapper, InplaceOptimWrapper])
def test_state_dict_round_trip(source, step_in_backward):
    ref, ref_wrapper = build(source, 'adamw')
    train(ref, ref_wrapper, 3)
    state = copy.deepcopy(ref_wrapper.state_dict())
    model, wrapper = build(
        InplaceOptimWrapper, 'adamw', step_in_backward=step_in_backward)
    model.load_state_dict(ref.state_dict())
    wrapper.load_state_dict(state)
    assert all(g['foreach'] is False for g in wrapper.optimizer.param_groups)
    assert_same_state(ref_wrapper, wrapper)
    train(ref, ref_wrapper, 3, start=3)
    train(model, wrapper, 3, start=3)
    assert_same_params(ref, model)
    assert_same_state(ref_wrapper, wrapper)


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_step_in_backward_lowers_peak_by_the_gradients(name):
    """An MLP of large Linear layers and a batch of 4: gradients dominate."""
    peaks = {}
    for step_in_backward in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[
            nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(8)
        ])
        cls, kwargs = OPTIMIZERS[name]
        wrapper = InplaceOptimWrapper(
            cls(model.parameters(), **kwargs),
            step_in_backward=step_in_backward)
        inputs = torch.randn(4, 1024)

        def step():
            with wrapper.optim_context(model):
                loss = model(inputs).square().mean()
            wrapper.update_params(loss)

        step()  # the optimizer state is allocated outside the measurement
        _, peaks[step_in_backward] = measure_peak_memory(step)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    drop = peaks[False] - peaks[True]
    print(f'{name}: peak {peaks[False]} B -> {peaks[True]} B, drop {drop} '
          f'B = {drop / grad_bytes:.1%} of {grad_bytes} B of gradients')
    assert drop >= 0.6 * grad_bytes


@pytest.mark.parametrize('kwargs, hint', [
    (dict(step_in_backwards=True), 'step_in_backwards to step_in_backward'),
    (dict(paramwise_cfgs=dict()), 'paramwise_cfgs to paramwise_cfg'),
    (dict(amp=dict(loss_scale=dict(init_scal=2.0))),
     'init_scal to init_scale'),
    (dict(clip_grad=dict(max_norm=1.0, norm_typ=2)), 'norm_typ to norm_type'),
])
def test_unknown_keys_name_the_closest_accepted_one(kwargs, hint):
    with pytest.raises(MmdtrError) as info:
        build(InplaceOptimWrapper, **kwargs)
    assert hint in info.value.hint


@pytest.mark.parametrize('optimizer', ['sgd', dict(type='SGD', lr=0.1)])
def test_an_optimizer_not_built_is_refused_by_name(optimizer):
    with pytest.raises(MmdtrError, match='optimizer must be a torch.optim'):
        InplaceOptimWrapper(optimizer)


class ForeachLBFGS(torch.optim.LBFGS):
    """Not per-parameter, with a ``foreach`` option that make_inplace sets."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for settings in (self.defaults, *self.param_groups):
            settings['foreach'] = None


@pytest.mark.parametrize('case', ['amp_dtype', 'amp_str', 'lbfgs'])
def test_failed_construction_leaves_nothing_applied(case):
    """No hook is left on any parameter; the optimizer is as it was."""
    torch.manual_seed(0)
    model = TiedNet()
    kwargs = dict(step_in_backward=True)
    if case == 'lbfgs':
        optimizer = ForeachLBFGS(model.parameters())
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        kwargs['amp'] = dict(dtype='float32', loss_scale=None) \
            if case == 'amp_dtype' else 'bfloat16'
    defaults = copy.deepcopy(optimizer.defaults)
    groups = copy.deepcopy(optimizer.state_dict()['param_groups'])
    with pytest.raises(MmdtrError):
        InplaceOptimWrapper(optimizer, **kwargs)
    assert all(not getattr(p, '_post_accumulate_grad_hooks', None)
               for p in model.parameters())
    assert optimizer.defaults == defaults
    assert optimizer.state_dict()['param_groups'] == groups


@pytest.mark.parametrize('clip_grad', [
    dict(max_norm=0.05, norm_type='inf'),
    dict(
        type='norm',
        max_norm=1,
        norm_type=float('inf'),
        error_if_nonfinite=False,
        foreach=None),
    dict(type='value', clip_value=0.01, foreach=False),
])
def test_accepted_clip_grad_forms_match_optim_wrapper(clip_grad):
    """Every form MMEngine's OptimWrapper takes is taken, with its result."""
    ref, ref_wrapper = build(OptimWrapper, 'sgd', clip_grad=dict(clip_grad))
    model, wrapper = build(InplaceOptimWrapper, 'sgd', clip_grad=clip_grad)
    train(ref, ref_wrapper, 3)
    train(model, wrapper, 3)
    assert_same_params(ref, model)


@pytest.mark.parametrize('loss_scale, scale', [
    ('dynamic', 2.0**16),
    (8, 8.0),
    (dict(init_scale=4.0, growth_interval=10, enabled=True), 4.0),
])
def test_accepted_loss_scales(loss_scale, scale):
    model, wrapper = build(
        InplaceOptimWrapper, amp=dict(dtype='bfloat16', loss_scale=loss_scale))
    before = copy.deepcopy(model.state_dict())
    train(model, wrapper, 1)
    assert wrapper.loss_scaler.get_scale() == scale
    assert not torch.equal(before['body.0.weight'], model.body[0].weight)


def test_step_in_backward_refuses_distributed_wrappers():
    model, wrapper = build(InplaceOptimWrapper, step_in_backward=True)
    with pytest.raises(MmdtrError, match='DataParallel'):
        with wrapper.optim_context(nn.DataParallel(model)):
            pass


def test_step_in_backward_refuses_two_backwards_in_a_row():
    model, wrapper = build(InplaceOptimWrapper, step_in_backward=True)
    wrapper.backward(model(tokens(0)))
    with pytest.raises(MmdtrError, match='two backward calls'):
        wrapper.backward(model(tokens(1)))


@pytest.mark.parametrize('fails_in', ['update_params', 'train_step'])
def test_step_in_backward_trains_on_after_a_failed_iteration(fails_in):
    # an error between backward and step (a loss-spike guard in a step
    # pre-hook, or the model's own code) left every later backward refused
    model, wrapper = build(InplaceOptimWrapper, step_in_backward=True)
    guard = wrapper.optimizer.register_step_pre_hook(
        lambda *args: (_ for _ in ()).throw(ValueError('loss spike')))
    with pytest.raises(ValueError, match='loss spike'):
        with wrapper.optim_context(model):
            loss = model(tokens(0))
        if fails_in == 'update_params':
            wrapper.update_params(loss)
        else:
            wrapper.backward(loss)
            raise ValueError('loss spike')
    guard.remove()
    if fails_in == 'train_step':  # the caller gives the step up
        wrapper.zero_grad()
    train(model, wrapper, 2, start=1)


def test_step_in_backward_refuses_accumulation_by_hand():
    # MMEngine's accumulation idiom enters optim_context once per
    # micro-batch: each backward steps every parameter on a partial
    # gradient, and the refusal must not be reset there
    model, wrapper = build(InplaceOptimWrapper, step_in_backward=True)
    with pytest.raises(MmdtrError, match='two backward calls'):
        for i in range(2):
            with wrapper.optim_context(model):
                loss = model(tokens(i))
            wrapper.backward(loss)


def scaled_steps(model, opt, scaler, autocast, inputs, iters, max_norm=0.05):
    """The hand-written AMP loop: autocast (``(device_type, dtype)``),
    scaled backward, unscale, norm clipping, step, update."""
    for i in range(iters):
        with torch.autocast(autocast[0], dtype=autocast[1]):
            loss = model(inputs(i))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_amp_matches_autocast_and_grad_scaler():
    """AMP on CPU: bfloat16 autocast, dynamic scaling, norm clipping."""
    ref, ref_wrapper = build(OptimWrapper, 'adamw')
    opt, scaler = ref_wrapper.optimizer, torch.amp.GradScaler('cpu')
    scaled_steps(ref, opt, scaler, ('cpu', torch.bfloat16), tokens, 3)
    model, wrapper = build(
        InplaceOptimWrapper,
        'adamw',
        clip_grad=dict(max_norm=0.05),
        amp=dict(dtype='bfloat16', loss_scale='dynamic'))
    with wrapper.optim_context(model):
        assert model.body[0](torch.ones(1, 8)).dtype == torch.bfloat16
    train(model, wrapper, 3)
    assert_same_params(ref, model)
    assert wrapper.state_dict()['loss_scaler'] == scaler.state_dict()


def test_amp_without_loss_scale_in_backward():
    ref, ref_wrapper = build(OptimWrapper, 'sgd')
    for i in range(3):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            loss = ref(tokens(i))
        ref_wrapper.update_params(loss)
    model, wrapper = build(
        InplaceOptimWrapper,
        'sgd',
        step_in_backward=True,
        amp=dict(dtype='bfloat16', loss_scale=None))
    train(model, wrapper, 3)
    assert_same_params(ref, model)
    assert 'loss_scaler' not in wrapper.state_dict()


def test_static_loss_scale_stays():
    model, wrapper = build(
        InplaceOptimWrapper, amp=dict(dtype='float16', loss_scale=8.0))
    train(model, wrapper, 2)
    assert wrapper.loss_scaler.get_scale() == 8.0


def test_static_loss_scale_stays_after_an_overflow():
    # a step that overflows is skipped and the static scale kept, as
    # MMEngine's AmpOptimWrapper keeps it; backed off to 256, the second
    # step (finite at 256) was taken (found by mutation testing)
    torch.manual_seed(0)
    model = nn.Linear(2, 1, bias=False)
    before = model.weight.detach().clone()
    wrapper = InplaceOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        amp=dict(dtype='bfloat16', loss_scale=512.0))
    big = torch.finfo(torch.float32).max / 300  # x512 overflows, x256 not
    for _ in range(2):
        with wrapper.optim_context(model):
            loss = model(torch.ones(1, 2)).sum().float() * big
        wrapper.update_params(loss)
        assert wrapper.loss_scaler.get_scale() == 512.0
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize('step_in_backward', [False, True])
@pytest.mark.parametrize('value', [False, None, 0])
def test_zeroed_gradients_are_refused_before_the_step(step_in_backward, value):
    # accepted, they left an unused branch's parameters unstepped where
    # OptimWrapper's zeroed gradients step them through weight decay and
    # momentum: every parameter differed (found by an adversarial search)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = copy.deepcopy(model.state_dict())
    wrapper = InplaceOptimWrapper(
        torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        step_in_backward=step_in_backward)
    loss = model(torch.randn(3, 4)).sum()
    with pytest.raises(MmdtrError, match=r'set_to_none=.* is not accepted'):
        wrapper.update_params(loss, zero_kwargs=dict(set_to_none=value))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])  # nothing stepped
    assert model.weight.grad is None  # nor back-propagated
    with pytest.raises(MmdtrError, match=r'set_to_none=.* is not accepted'):
        wrapper.zero_grad(set_to_none=value)
    wrapper.update_params(
        model(torch.randn(3, 4)).sum(), zero_kwargs=dict(set_to_none=True))
    assert not torch.equal(model.weight, before['weight'])
