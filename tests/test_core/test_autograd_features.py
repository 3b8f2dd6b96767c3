"""Bit-exactness of DTR with autograd's and ``torch.nn``'s other features.

From an adversarial search of 2026-11-29 (all of these matched eager
then; the suite had none of them in these forms): higher-order
gradients, gradients asked for twice, tensor and module hooks,
``backward(inputs=...)``, custom ``autograd.Function``s (``mark_dirty``,
a tensor kept on ``ctx``), parametrizations whose buffers are written in
place in forward (spectral norm's power iteration), an embedding whose
``max_norm`` renormalises its weight in place, attention and recurrent
layers with dropout, and random ops other than dropout. Each step runs
two iterations with an in-place SGD update between them, under the
oracle of tests/conftest.py at 30% of the baseline peak and at 1 byte.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations, spectral_norm

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))


def _two_iterations(loss_of):
    """A step: ``loss_of(model)`` (which calls backward), an SGD update in
    place, then ``loss_of`` again; returns the sum of both losses."""

    def step(model):
        first = loss_of(model)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        return first + loss_of(model)

    return step


class MLP(nn.Module):

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 32)
        self.l3 = nn.Linear(32, 1)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(F.softplus(self.l1(x)))))


def _gradient_penalty(model):
    x = X.clone().requires_grad_()
    y = model(x).sum()
    g, = torch.autograd.grad(y, x, create_graph=True)
    gg, = torch.autograd.grad(g.sum(), x, create_graph=True)
    loss = y + (g.norm(dim=1) - 1).square().mean() + gg.square().sum()
    loss.backward()
    return loss.detach()


def _grad_then_backward_twice(model):
    y = model(X)
    first, second = y.sum(), y.square().sum()
    grads = torch.autograd.grad(
        first, list(model.parameters()), retain_graph=True)
    second.backward(retain_graph=True)
    second.backward()
    for p, g in zip(model.parameters(), grads):
        p.grad.add_(g)
    return (first + second).detach()


def _tensor_hooks(model):
    y = model.l1(X)
    y.register_hook(lambda g: g * 2)
    h = torch.tanh(model.l2(F.softplus(y)))
    h.retain_grad()
    h.register_hook(lambda g: g.clamp(-0.01, 0.01))
    h.grad_fn.register_prehook(lambda gs: (gs[0] * 0.5, ))
    loss = model.l3(h).square().sum()
    loss.backward(inputs=[model.l1.weight, model.l3.weight, h])
    return torch.cat([loss.detach().view(1), h.grad.flatten()])


class HookedMLP(MLP):

    def __init__(self):
        super().__init__()
        self.l2.register_forward_pre_hook(lambda m, i: (i[0] * 0.5 + 1, ))
        self.l2.register_full_backward_hook(lambda m, gi, go: (gi[0] * 3, ))
        self.l1.register_forward_hook(lambda m, i, out: out.relu())
        self.l3.register_full_backward_pre_hook(lambda m, go: (go[0] * .7, ))


def _plain(model, inputs=X):
    loss = model(inputs).square().sum()
    loss.backward()
    return loss.detach()


class TanhWithExtra(torch.autograd.Function):
    """Saves its input, weight and output, and keeps a tensor on ``ctx``."""

    @staticmethod
    def forward(ctx, x, w):
        y = x @ w
        ctx.save_for_backward(x, w, y)
        ctx.extra = y.sin()
        return y.tanh()

    @staticmethod
    def backward(ctx, g):
        x, w, y = ctx.saved_tensors
        gy = g * (1 - y.tanh()**2) + ctx.extra * 0.5
        return gy @ w.t(), x.t() @ gy


class DoubleInPlace(torch.autograd.Function):
    """Writes its input in place (``mark_dirty``)."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class CustomFunctions(nn.Module):

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 4)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = self.l1(x).sigmoid()
        h = TanhWithExtra.apply(h * 2, self.w)
        return self.l2(DoubleInPlace.apply(h * 3).cos() + h)


def _parametrized():
    """Weight norm, spectral norm (both kinds: their power iteration writes
    buffers in place in forward) and an orthogonal weight."""
    model = nn.Sequential(
        nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 4))
    parametrizations.weight_norm(model[0])
    parametrizations.spectral_norm(model[2])
    spectral_norm(model[4])
    parametrizations.orthogonal(model[6])
    return model


class Embeddings(nn.Module):
    """``max_norm`` renormalises the looked-up rows of the weight in place
    in forward; the second lookup reads the written weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16, padding_idx=0, max_norm=1.0)
        self.bag = nn.EmbeddingBag(30, 16, mode='mean', max_norm=2.0)
        self.lin = nn.Linear(16, 16)

    def forward(self, tokens):
        h = self.lin(self.emb(tokens)).relu()
        again = self.emb(tokens.flip(1))
        return (h.sum(1) * self.bag(tokens)).sum() + again.tanh().sum()


TOKENS = torch.randint(
    0, 30, (4, 7), generator=torch.Generator().manual_seed(2))
SEQUENCE = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(3))


def _attention(model):
    out, weights = model(
        SEQUENCE,
        SEQUENCE * 0.5,
        SEQUENCE,
        need_weights=True,
        average_attn_weights=False)
    loss = out.square().sum() + weights.sum()
    loss.backward()
    return loss.detach()


class Recurrent(nn.Module):

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(
            16, 12, 2, batch_first=True, dropout=0.3, bidirectional=True)
        self.gru = nn.GRU(24, 8, batch_first=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        out, last = self.gru(out)
        return out.square().sum() + h.sum() + c.sum() + last.sum()


class RandomOps(nn.Module):
    """Random ops other than dropout, from the default generator and from
    the model's own."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.generator = torch.Generator().manual_seed(123)

    def forward(self, x):
        h = self.l1(x)
        h = h * torch.rand_like(h) + torch.randn_like(h) * 0.1
        h = h * torch.empty_like(h).bernoulli_(0.7)
        h = h[:, torch.randperm(16)]
        picked = torch.multinomial(h.softmax(-1), 3)
        h = h + h.gather(1, picked).mean(1, keepdim=True)
        h = F.gumbel_softmax(self.l2(h), tau=0.5, hard=True) + h
        h = h * torch.rand(h.shape, generator=self.generator)
        h = F.alpha_dropout(h, 0.2, True) + F.rrelu(h, training=True)
        return h + torch.normal(h, 0.1)


CASES = {
    'gradient_penalty': (MLP, _gradient_penalty),
    'grad_then_backward_twice': (MLP, _grad_then_backward_twice),
    'tensor_hooks': (MLP, _tensor_hooks),
    'module_hooks': (HookedMLP, _plain),
    'custom_functions': (CustomFunctions, _plain),
    'parametrizations': (_parametrized, _plain),
    'embedding_max_norm': (Embeddings, lambda m: _plain(m, TOKENS)),
    'attention_dropout':
    (lambda: nn.MultiheadAttention(16, 4, dropout=0.2, batch_first=True),
     _attention),
    'recurrent_dropout': (Recurrent, lambda m: _plain(m, SEQUENCE)),
    'random_ops': (RandomOps, _plain),
}


@pytest.mark.parametrize('name', sorted(CASES))
def test_bit_identical_with_autograd_features(name, oracle):
    make, loss_of = CASES[name]
    torch.manual_seed(0)
    check = oracle(make(), _two_iterations(loss_of))
    check.run(check.baseline_peak * 0.3)
    stats = check.run(1)
    assert stats.evictions > 0 and stats.recomputations > 0, stats
