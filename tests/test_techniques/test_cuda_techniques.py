"""Activation checkpointing, selective policies and per-parameter steps on
CUDA, bit for bit against the same steps without them.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_techniques/test_cuda_techniques.py``.
Deterministic algorithms are on, so that the plain run and the recompute
pick the same kernels.
"""
import copy

import pytest
import torch
import torch.nn as nn

from mmdtr.dtr import DTR
from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import \
    apply_activation_checkpointing
from mmdtr.techniques.inplace_update import PerParameterStepper, make_inplace

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason='needs CUDA')
CUDA = torch.device('cuda', 0)


@pytest.fixture(autouse=True)
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before)


class Attention(nn.Module):
    """Self-attention with dropout on the weights, then an MLP."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads,
                                   -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1) * (c // self.heads)**-0.5)
        out = self.drop(attn.softmax(-1)) @ v
        x = x + self.proj(out.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm(x))


def conv_net():
    layers = [nn.Conv2d(3, 32, 3, padding=1)]
    for _ in range(4):
        layers.append(
            nn.Sequential(
                nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32),
                nn.ReLU(inplace=True), nn.Dropout(0.1)))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


MODELS = {
    'conv':
    (conv_net, lambda g: torch.randn(8, 3, 32, 32, device=CUDA, generator=g)),
    'attention': (lambda: nn.Sequential(*[Attention() for _ in range(3)]),
                  lambda g: torch.randn(4, 16, 64, device=CUDA, generator=g)),
}


def _steps(model, make_input, steps=2, engine=None, evictions=None):
    """Two SGD steps; returns losses, grads, buffers, params, RNG state.

    Under ``engine`` (DTR's arguments), each step's evictions are appended
    to ``evictions``.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator(CUDA).manual_seed(1)
    losses = []
    for _ in range(steps):
        torch.manual_seed(2)  # dropout draws from the CUDA generator
        x = make_input(g)
        if engine is not None:
            with DTR(**engine) as dtr:
                loss = model(x).square().mean()
                loss.backward()
            evictions.append(dtr.stats.evictions)
        else:
            loss = model(x).square().mean()
            loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return (losses, grads, [b.clone() for b in model.buffers()],
            [p.detach().clone()
             for p in model.parameters()], torch.cuda.get_rng_state(CUDA))


def _assert_same(ref, got):
    for name, a, b in zip(('loss', 'grad', 'buffer', 'param'), ref, got):
        assert len(a) == len(b), name
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), (name, i)
    assert torch.equal(ref[4], got[4]), 'CUDA RNG stream shifted'


def _pair(name):
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    plain = build().to(CUDA)
    return plain, copy.deepcopy(plain), make_input


@pytest.mark.parametrize('name', sorted(MODELS))
@pytest.mark.parametrize('policy', [None, 'save_compute_heavy'])
def test_checkpointing_is_bit_identical_on_cuda(name, policy):
    plain, model, make_input = _pair(name)
    names = apply_activation_checkpointing(model, ['1', '2'], policy=policy)
    assert names == ['1', '2']
    _assert_same(_steps(plain, make_input), _steps(model, make_input))


def test_checkpointing_under_dtr_is_bit_identical_on_cuda():
    plain, model, make_input = _pair('conv')
    apply_activation_checkpointing(model, ['2', '3'])
    # a threshold far below the step's memory: DTR evicts on every step
    engine = dict(eviction_threshold=2**20, evictee_minimum_size=1)
    evictions = []
    got = _steps(model, make_input, engine=engine, evictions=evictions)
    _assert_same(_steps(plain, make_input), got)
    assert len(evictions) == 2 and min(evictions) > 0, evictions


def test_written_kept_output_refused_on_cuda():
    """A kept bmm output scaled in place: refused, as on CPU."""

    class Scaled(nn.Module):

        def forward(self, q, k):
            s = q @ k.transpose(-2, -1)
            s.mul_(0.5)
            return s.softmax(-1)

    model = nn.ModuleDict(dict(s=Scaled()))
    apply_activation_checkpointing(model, ['s'], policy='save_compute_heavy')
    q = torch.randn(2, 4, 8, 16, device=CUDA, requires_grad=True)
    with pytest.raises(MmdtrError, match='mmdtr:'):
        model['s'](q, q.detach().clone()).sum().backward()


@pytest.mark.parametrize('name', sorted(MODELS))
def test_step_in_backward_is_bit_identical_on_cuda(name):
    plain, model, make_input = _pair(name)
    # the reference steps with the loop too: torch's CUDA default, foreach
    # steps, may differ in the last bits (docs/inplace_optim_wrapper.md)
    ref = torch.optim.AdamW(
        plain.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    make_inplace(opt)
    stepper = PerParameterStepper(opt)
    g, h = (torch.Generator(CUDA).manual_seed(1) for _ in range(2))
    for _ in range(3):
        torch.manual_seed(2)
        plain(make_input(g)).square().mean().backward()
        ref.step()
        ref.zero_grad()
        torch.manual_seed(2)
        stepper.begin()
        model(make_input(h)).square().mean().backward()
        stepper.end()
    for (key, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p, q), key
    for key, b in plain.named_buffers():
        assert torch.equal(b, model.get_buffer(key)), key
