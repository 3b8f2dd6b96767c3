"""Efficient Conv-BN eval: same results with frozen BN, less memory."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from mmengine.model.efficient_conv_bn_eval import \
    efficient_conv_bn_eval_control as fused
from mmengine.model.efficient_conv_bn_eval import \
    turn_on_efficient_conv_bn_eval

from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import (
    apply_activation_checkpointing, is_checkpointed)
from mmdtr.techniques.efficient_conv_bn_eval import (
    apply_efficient_conv_bn_eval, find_conv_bn_pairs)
from mmdtr.utils.profiler_memory import measure_peak_memory


def _cbr(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class Chain(nn.Module):
    """A Conv-BN-ReLU chain, with a BN after an add and a transposed conv."""

    def __init__(self, width=16, depth=4):
        super().__init__()
        self.bn_in = nn.BatchNorm2d(3)
        self.layers = nn.Sequential(
            _cbr(3, width), *[_cbr(width, width) for _ in range(depth - 1)])
        self.up = nn.ConvTranspose2d(width, width, 2, stride=2)
        self.bn_up = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        x = self.layers(self.bn_in(x + 1))  # BN fed by an add, not a module
        x = self.bn_up(self.up(x))  # transposed: must stay unfused
        return self.head(x.mean((2, 3)))


class Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.bn(self.conv(x))
        if x.sum() > 0:
            x = x * 2
        return x


class TrainOnly(nn.Module):
    """Adds 1 in training mode only: a trace must not bake the branch."""

    def forward(self, x):
        return x + 1 if self.training else x


class Owner(nn.Module):

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.extra = TrainOnly()

    def forward(self, x):
        return self.extra(self.bn(self.conv(x)))


def _frozen(model):
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    model.train()
    for m in model.modules():  # frozen BN, weights training (norm_eval)
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


def _step(model, x):
    out = model(x)
    out.square().mean().backward()
    return out.detach()


def _assert_close(plain, fused_model, x):
    out_plain = _step(plain, x)
    out_fused = _step(fused_model, x)
    assert torch.allclose(out_plain, out_fused, rtol=1e-4, atol=1e-6)
    for (name, p), (_, q) in zip(plain.named_parameters(),
                                 fused_model.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-6), name
    for (name, p), (_, q) in zip(plain.named_buffers(),
                                 fused_model.named_buffers()):
        assert torch.equal(p, q), name


def test_outputs_and_gradients_match_with_frozen_bn():
    torch.manual_seed(0)
    plain = _frozen(Chain())
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # fully fused: no warning
        (result, ) = apply_efficient_conv_bn_eval(model, ['layers'], fused)
    assert result.fused_pairs == 4
    assert result.traced == [f'layers.{i}' for i in range(4)]
    x = torch.randn(4, 3, 16, 16)
    _assert_close(plain, model, x)


def test_pairs_skip_transposed_conv_and_non_module_inputs():
    model = Chain()
    gm = torch.fx.symbolic_trace(model)
    pairs = [(c.target, b.target) for c, b in find_conv_bn_pairs(gm)]
    assert pairs == [(f'layers.{i}.0', f'layers.{i}.1') for i in range(4)]


def test_training_mode_bn_falls_back_bit_identical():
    torch.manual_seed(0)
    plain = Chain().train()
    model = copy.deepcopy(plain)
    apply_efficient_conv_bn_eval(model, 'layers', fused)
    x = torch.randn(4, 3, 8, 8)
    assert torch.equal(_step(plain, x), _step(model, x))
    for (name, p), (_, q) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(p, q), name  # running stats updated the same


def test_memory_drops_by_a_fifth():
    torch.manual_seed(0)
    plain = _frozen(
        nn.Sequential(_cbr(3, 16), *[_cbr(16, 16) for _ in range(5)]))
    model = copy.deepcopy(plain)
    results = apply_efficient_conv_bn_eval(model, '*', fused)
    assert [r.fused_pairs for r in results] == [1] * 6
    x = torch.randn(8, 3, 32, 32)
    _, peak_plain = measure_peak_memory(_step, plain, x)
    _, peak_fused = measure_peak_memory(_step, model, x)
    assert peak_fused <= 0.8 * peak_plain  # measured: 0.63


def test_unknown_name_raises_with_closest():
    with pytest.raises(MmdtrError) as info:
        apply_efficient_conv_bn_eval(Chain(), ['layers', 'layer'], fused)
    text = str(info.value)
    assert text.startswith('mmdtr: efficient_conv_bn_eval:')
    assert "'layer'" in text and "closest matches: ['layers'" in text


def test_warnings_name_the_module_and_why():
    model = Chain()
    with pytest.warns(UserWarning) as record:
        results = apply_efficient_conv_bn_eval(model, ['head', 'bn_up'], fused)
    messages = [str(w.message) for w in record]
    assert [r.name for r in results] == ['bn_up', 'head']  # model order
    assert not any(r.enabled for r in results)
    assert any("in module 'head'" in m and 'single layer (Linear)' in m
               for m in messages)
    assert any("in module 'bn_up'" in m for m in messages)
    with pytest.warns(UserWarning, match='no module in it calls a Conv'):
        apply_efficient_conv_bn_eval(
            nn.Sequential(nn.Sequential(nn.Linear(2, 2))), '0', fused)


def test_trace_failure_is_reported_and_confined():
    torch.manual_seed(0)
    plain = _frozen(nn.Sequential(nn.Sequential(Branchy(), _cbr(4, 4))))
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning) as record:
        (result, ) = apply_efficient_conv_bn_eval(model, '0', fused)
    message = str(record[0].message)
    assert "module '0' is only partly fused" in message
    assert "'0.0': torch.fx tracing failed (TraceError" in message
    assert 'control flow' in message
    assert result.traced == ['0.1'] and result.fused_pairs == 1
    _assert_close(plain, model, torch.randn(2, 4, 8, 8))


def test_trace_keeps_child_control_flow_live():
    torch.manual_seed(0)
    plain = _frozen(nn.Sequential(Owner()))
    model = copy.deepcopy(plain)
    (result, ) = apply_efficient_conv_bn_eval(model, '0', fused)
    assert result.traced == ['0'] and result.fused_pairs == 1
    x = torch.randn(2, 3, 8, 8)
    for mode in (True, False):  # traced in train mode, run in both
        plain.train(mode), model.train(mode)
        assert torch.allclose(plain(x), model(x), rtol=1e-4, atol=1e-6)


def test_native_support_is_kept_whole():
    model = Chain()
    native = [model.layers[1]]

    def support(module):
        return module in native

    (result, ) = apply_efficient_conv_bn_eval(model, 'layers', fused, support)
    assert result.native_modules == 1
    assert result.fused_pairs == 3  # layers.1 is a leaf of the trace


def test_then_checkpointing_is_bit_identical_to_fused_alone():
    torch.manual_seed(0)
    fused_only = _frozen(Chain())
    apply_efficient_conv_bn_eval(fused_only, 'layers', fused)
    both = copy.deepcopy(fused_only)
    assert apply_activation_checkpointing(both, ['layers', 'layers.1'
                                                 ]) == ['layers']
    assert apply_activation_checkpointing(both, 'layers.1') == ['layers.1']
    assert is_checkpointed(both.layers) and is_checkpointed(both.layers[1])
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(_step(fused_only, x), _step(both, x))
    for p, q in zip(fused_only.parameters(), both.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_checkpointing_inside_a_whole_model_trace_is_refused():
    model = Chain()
    turn_on_efficient_conv_bn_eval(model, ['layers'])  # MMEngine's
    with pytest.raises(MmdtrError, match="inside 'layers', whose forward"):
        apply_activation_checkpointing(model, 'layers.1')
    apply_activation_checkpointing(model, 'layers')  # the traced one: fine


@pytest.mark.parametrize('order', ['child first', 'same module first'])
def test_checkpointing_first_keeps_checkpoints(order):
    torch.manual_seed(0)
    plain = _frozen(Chain())
    model = copy.deepcopy(plain)
    if order == 'child first':
        apply_activation_checkpointing(model, 'layers.0')
        (result, ) = apply_efficient_conv_bn_eval(model, 'layers', fused)
        assert is_checkpointed(model.layers[0])
        apply_activation_checkpointing(model, 'layers')
    else:
        apply_activation_checkpointing(model, 'layers')
        (result, ) = apply_efficient_conv_bn_eval(model, 'layers', fused)
    assert result.fused_pairs == 4  # traces run inside the checkpoints
    assert is_checkpointed(model.layers)
    _assert_close(plain, model, torch.randn(2, 3, 8, 8))


class StandardizedConv(nn.Conv2d):
    """A Conv2d with a forward of its own (as mmcv's ConvWS2d)."""

    def forward(self, x):
        w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
        return self._conv_forward(x, w, self.bias)


def _conv_then_bn(conv):
    return nn.Sequential(nn.Sequential(conv, nn.BatchNorm2d(4)))


@pytest.mark.parametrize('case', ['subclass forward', 'forward hook'])
def test_conv_whose_call_does_more_stays_unfused(case):
    # the fused form calls conv._conv_forward: a subclass's forward or a
    # hook was skipped, in training mode (bit-identical, the docs say) too
    torch.manual_seed(0)
    if case == 'subclass forward':
        conv = StandardizedConv(3, 4, 3)
    else:
        conv = nn.Conv2d(3, 4, 3)
        conv.register_forward_hook(lambda m, args, out: out * 2)
    plain = _conv_then_bn(conv)
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match="torch's own forward without hooks"):
        (result, ) = apply_efficient_conv_bn_eval(model, '0', fused)
    assert not result.enabled
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(plain(x), model(x))  # training mode


def test_mmcv_conv_wrapper_is_fused():
    # mmcv's Conv2d wrapper ('Conv') computes what nn.Conv2d does
    from mmcv.cnn.bricks.wrappers import Conv2d
    torch.manual_seed(0)
    plain = _frozen(_conv_then_bn(Conv2d(3, 4, 3)))
    model = copy.deepcopy(plain)
    (result, ) = apply_efficient_conv_bn_eval(model, '0', fused)
    assert result.fused_pairs == 1
    _assert_close(plain, model, torch.randn(2, 3, 8, 8))


class DropoutOnOwnFlag(nn.Module):
    """Reads its own training flag: a trace would fix it."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return nn.functional.dropout(
            self.bn(self.conv(x)), 0.5, training=self.training)


def test_module_reading_its_own_training_flag_is_not_traced():
    # applied in train mode (before_test comes before model.eval()), the
    # trace kept dropout on in eval
    model = nn.Sequential(DropoutOnOwnFlag())
    with pytest.warns(UserWarning, match=r'reads a training flag'):
        (result, ) = apply_efficient_conv_bn_eval(model, '0', fused)
    assert not result.enabled and model.training
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(model(x), model(x))  # no dropout in eval


class _SwitchesModes(nn.Module):

    def __init__(self, switch):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.gate, self.switch = nn.Conv2d(4, 4, 1), switch

    def forward(self, x):
        y = self.bn(self.conv(x))
        with self.switch():
            g = self.gate(x).sigmoid()
        return y * g.float()


@pytest.mark.parametrize(
    'switch', [
        torch.no_grad, torch.enable_grad,
        lambda: torch.autocast('cpu', enabled=False),
        lambda: torch.autocast('cpu', dtype=torch.bfloat16)
    ],
    ids=['no_grad', 'enable_grad', 'autocast_off', 'autocast_on'])
def test_module_switching_grad_or_autocast_is_not_traced(switch):
    # a trace runs the block but records nothing of it: the fused forward
    # gave the gate a gradient, and other dtypes under autocast (found by
    # an adversarial search)
    model = nn.Sequential(_SwitchesModes(switch))
    with pytest.warns(UserWarning, match='switches grad mode or autocast'):
        (result, ) = apply_efficient_conv_bn_eval(model, '0', fused)
    assert not result.enabled and result.fused_pairs == 0
