"""Efficient Conv-BN eval: a module changed after its Conv+BN pairs were
fused runs as it now is (found by an adversarial search)."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from mmengine.model.efficient_conv_bn_eval import \
    efficient_conv_bn_eval_control as fused
from torch.nn.utils.parametrizations import spectral_norm

from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import (
    apply_activation_checkpointing, is_checkpointed)
from mmdtr.techniques.efficient_conv_bn_eval import \
    apply_efficient_conv_bn_eval


class ScaledBlock(nn.Module):
    """A Conv+BN pair plus a parameter and a buffer of the block itself,
    which its trace reads with ``get_attr``."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.gamma = nn.Parameter(torch.ones(4, 1, 1))
        self.register_buffer('shift', torch.zeros(4, 1, 1))

    def forward(self, x):
        return self.bn(self.conv(x)) * self.gamma + self.shift


def _pair(block):
    torch.manual_seed(0)
    plain = nn.Sequential(block).eval()
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        (result, ) = apply_efficient_conv_bn_eval(model, '0', fused)
    return plain, model, result


def _close(plain, model, x):
    a, b = plain(x), model(x)
    assert a.dtype == b.dtype and a.device == b.device
    assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    'change', ['assign', 'buffer', 'bfloat16', 'meta', 'now a buffer'])
def test_parameters_and_buffers_replaced_are_read(change):
    # the trace held the tensors it was made with: outputs off by up to 10,
    # gamma got no gradient, or a dtype or device error
    plain, model, result = _pair(ScaledBlock())
    assert result.fused_pairs == 1
    x = torch.randn(2, 3, 6, 6)
    state = {k: v + 1 for k, v in plain.state_dict().items()}
    for m in (plain, model):
        if change == 'assign':
            m.load_state_dict(copy.deepcopy(state), assign=True)
        elif change == 'buffer':
            m[0].shift = torch.full((4, 1, 1), 3.0)
        elif change == 'bfloat16':
            m.bfloat16()
        elif change == 'now a buffer':  # setattr refused (a review)
            gamma = m[0].gamma.detach() * 2
            del m[0].gamma
            m[0].register_buffer('gamma', gamma)
        else:
            m.to('meta')
    if change == 'bfloat16':
        x = x.bfloat16()
    elif change == 'meta':
        x = x.to('meta')
        assert model(x).device.type == 'meta'
        return
    _close(plain, model, x)
    if change == 'assign':
        model(x).sum().backward()
        assert model[0].gamma.grad is not None


def test_functional_call_reads_the_tensors_given():
    # torch.func puts plain tensors in _parameters: the rebinding raised
    # a TypeError (found by a review)
    plain, model, _ = _pair(ScaledBlock())
    x = torch.randn(2, 3, 6, 6)
    given = {k: v.detach() * 2 for k, v in plain.named_parameters()}
    a = torch.func.functional_call(plain, given, (x, ))
    b = torch.func.functional_call(model, given, (x, ))
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    _close(plain, model, x)  # its own parameters again


@pytest.mark.parametrize('hook', ['backward', 'global forward'])
def test_backward_and_global_hooks_run(hook):
    # only forward hooks of the pair's own modules were seen: a Grad-CAM
    # backward hook and a hook on every module were skipped (a review)
    plain, model, _ = _pair(ScaledBlock())
    calls = []
    x = torch.randn(2, 3, 6, 6)
    if hook == 'backward':
        for m in (plain, model):
            m[0].bn.register_full_backward_hook(
                lambda mod, grad_in, grad_out: calls.append(mod))
            m(x).sum().backward()
        assert len(calls) == 2
        return
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: calls.append(type(mod).__name__))
    try:
        plain(x), model(x)
    finally:
        handle.remove()
    half = len(calls) // 2
    assert calls[:half] == calls[half:] and 'Conv2d' in calls[half:]


def test_statistics_dropped_after_fusion_run_as_the_module():
    # TENT-style adaptation: BN switched to batch statistics after fusion;
    # the fused form then raised a TypeError on running_var=None
    plain, model, _ = _pair(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    for m in (plain, model):
        bn = m[0][1]
        bn.track_running_stats = False
        bn.running_mean = bn.running_var = None
    x = torch.randn(2, 3, 6, 6)
    assert torch.equal(plain(x), model(x))


def test_hook_added_after_fusion_runs():
    # the fused form calls neither module, so a feature recorder added
    # later was skipped
    plain, model, _ = _pair(ScaledBlock())
    seen = {id(plain): [], id(model): []}
    for m in (plain, model):
        m[0].bn.register_forward_hook(
            lambda mod, args, out, key=id(m): seen[key].append(out))
    x = torch.randn(2, 3, 6, 6)
    assert torch.equal(plain(x), model(x))
    assert len(seen[id(model)]) == 1
    assert torch.equal(seen[id(plain)][0], seen[id(model)][0])


def test_parametrized_conv_stays_unfused():
    # spectral_norm runs a power iteration at each read of the weight,
    # which the fused form reads twice: its _u buffer drifted (2.7e-2)
    plain, model, result = _pair(
        nn.Sequential(spectral_norm(nn.Conv2d(3, 4, 3)), nn.BatchNorm2d(4)))
    assert not result.enabled
    for m in (plain, model):
        m.train()
        m[0][1].eval()
    x = torch.randn(2, 3, 6, 6)
    for _ in range(2):
        assert torch.equal(plain(x), model(x))
    for a, b in zip(plain.buffers(), model.buffers()):
        assert torch.equal(a, b)


def test_checkpointing_the_conv_of_a_fused_conv_module_is_refused():
    # mmcv's fused ConvModule sets its conv's forward and then deletes it,
    # and the checkpoint with it: checkpointed at the first iteration only
    from mmcv.cnn import ConvModule
    model = nn.Sequential(
        ConvModule(3, 4, 3, norm_cfg=dict(type='BN')),
        ConvModule(4, 4, 3, norm_cfg=dict(type='BN')))
    for m in model:
        m.turn_on_efficient_conv_bn_eval(True)
    with pytest.raises(MmdtrError, match="checkpoint '0' .*instead"):
        apply_activation_checkpointing(model, ['1', '0.conv'])
    assert not any(map(is_checkpointed, model.modules()))  # nothing applied
    assert apply_activation_checkpointing(model, '0') == ['0']


@pytest.mark.parametrize('order', ['fuse first', 'checkpoint first'])
@pytest.mark.parametrize('change', ['hook added', 'hook removed'])
def test_recompute_takes_the_path_its_forward_took(order, change):
    # the guards are read at each call, and a recompute is a call: a hook
    # added or removed between forward and backward made it take the other
    # path, save another number of tensors, and torch's checkpoint raised
    # (found by a review)
    torch.manual_seed(0)
    plain = nn.Sequential(ScaledBlock(), nn.Conv2d(4, 2, 1)).eval()
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if order == 'fuse first':
            apply_efficient_conv_bn_eval(model, '0', fused)
            apply_activation_checkpointing(model, '0')
        else:
            apply_activation_checkpointing(model, '0')
            apply_efficient_conv_bn_eval(model, '0', fused)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    handles = []
    for m in (plain, model):
        if change == 'hook removed':
            handles.append(m[0].bn.register_forward_hook(lambda *a: None))
        loss = m(x).square().sum()
        if change == 'hook added':
            handles.append(m[0].bn.register_forward_hook(lambda *a: None))
        else:
            handles.pop().remove()
        loss.backward(retain_graph=True)
        loss.backward()  # a second recompute takes it again
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('change', ['hook added', 'hook removed'])
@pytest.mark.needs_selective_checkpointing
def test_nested_checkpoints_take_the_path_their_forward_took(change):
    # checkpointed twice ('0.0', then '0'): the outer recompute runs the
    # inner checkpoint's forward again, which chose afresh and, with a
    # selective policy, met ops its forward had not kept (a review)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(ScaledBlock()), nn.Conv2d(4, 2,
                                                                  1)).eval()
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        apply_efficient_conv_bn_eval(model, '0.0', fused)
    apply_activation_checkpointing(model, '0.0', 'save_compute_heavy')
    apply_activation_checkpointing(model, '0', 'save_compute_heavy')
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    for m in (plain, model):
        bn = m[0][0].bn
        handle = bn.register_forward_hook(lambda *a: None) \
            if change == 'hook removed' else None
        loss = m(x).square().sum()
        if handle is None:
            bn.register_forward_hook(lambda *a: None)
        else:
            handle.remove()
        loss.backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)
