"""How a checkpointed module is called: its mode from call to call, what it
returns, parameters not made yet, and containers it is given. Each case is
bit-identical to the plain model or refused with an MmdtrError (found by a
review, 2026-11-27)."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import \
    apply_activation_checkpointing


def _assert_same(plain: nn.Module, ckpt: nn.Module):
    for (name, p), (_, q) in zip(plain.named_parameters(),
                                 ckpt.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
        assert torch.equal(p, q), name
    for (name, b), (_, c) in zip(plain.named_buffers(), ckpt.named_buffers()):
        assert torch.equal(b, c), name


def _block():
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()))


def _inputs(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _plain_and_checkpointed(plain: nn.Module, modules, policy=None):
    """``plain`` and a copy of it with ``modules`` checkpointed."""
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, modules, policy)
    return plain, ckpt


def test_eval_call_then_training_call_is_refused():
    # the eval call's recompute read the running statistics the training
    # call updated since: every gradient differed, silently
    torch.manual_seed(0)
    model = _block()
    apply_activation_checkpointing(model, '0')
    x = _inputs(8, 4)
    model.eval()
    a = model(x)
    model.train()
    b = model(x * 2)
    with pytest.raises(MmdtrError, match='running statistics'):
        ((a - b)**2).sum().backward()


def _block_exact_for(step):
    """``step(model, x)`` on the plain block and on its checkpointed copy
    gives the same gradients and buffers."""
    torch.manual_seed(0)
    plain, ckpt = _plain_and_checkpointed(_block(), '0')
    x = _inputs(8, 4)
    for model in (plain, ckpt):
        step(model, x)
    _assert_same(plain, ckpt)


def test_training_call_then_eval_call_is_exact():
    # the other order is exact: the training call's recompute reads batch
    # statistics, the eval call's the statistics it read
    def step(model, x):
        model.train()
        a = model(x)
        model.eval()
        b = model(x * 2)
        ((a - b)**2).sum().backward()

    _block_exact_for(step)


def test_training_calls_around_an_eval_call_are_exact():
    # pseudo-labels from an eval-mode call with grad on, between two
    # training calls: refused at first, though only the eval call reads the
    # statistics and its graph is not backpropagated (found by a review)
    def step(model, x):
        model.train()
        a = model(x)
        model.eval()
        pseudo = model(x * 3).detach().argmax(1)
        model.train()
        c = model(x * 2)
        (a.sum() + nn.functional.cross_entropy(c, pseudo)).backward()

    _block_exact_for(step)


def test_modes_switched_between_steps_are_exact():
    # a mode switched after the backward of the last call refuses nothing
    def step(model, x):
        for training in (False, True, False):
            model.train(training)
            model(x).pow(2).sum().backward()

    _block_exact_for(step)


@dataclasses.dataclass
class _Output:
    feat: torch.Tensor


class _ReturnsADataclass(nn.Module):

    def __init__(self, writes_input=False):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.writes_input = writes_input

    def forward(self, x):
        if self.writes_input:
            x.mul_(2)
        return _Output(self.fc(x).tanh())


def test_module_returning_a_dataclass_trains_exactly():
    # no tensor was found in the output, so it was taken for a frozen
    # module's: its record was not brought up to date and the second step
    # was refused, though nothing was written
    torch.manual_seed(0)
    plain, ckpt = _plain_and_checkpointed(
        nn.ModuleDict(dict(block=_ReturnsADataclass())), 'block')
    x = _inputs(3, 4)
    for model in (plain, ckpt):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            model['block'](x).feat.pow(2).sum().backward()
            optimizer.step()
    _assert_same(plain, ckpt)


def test_module_returning_a_dataclass_writing_its_input_is_refused():
    # the checks after the forward were skipped: autograd's raw in-place
    # error came in backward instead
    model = nn.ModuleDict(
        dict(stem=nn.Linear(4, 4), block=_ReturnsADataclass(True)))
    apply_activation_checkpointing(model, 'block')
    with pytest.raises(MmdtrError, match='writes its input in place'):
        model['block'](model['stem'](_inputs(3, 4)))


class _Counted(nn.Module):
    """Tanh that counts its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.tanh()


def test_lazy_parameters_are_made_by_a_call_without_checkpoint():
    # a lazy layer draws its initial weights from the global RNG inside the
    # forward; the recompute restored the RNG state from before that draw,
    # so the dropout after it drew another mask: other gradients, silently.
    # Before this, a ValueError from reading an uninitialized parameter
    torch.manual_seed(0)
    plain, ckpt = _plain_and_checkpointed(
        nn.Sequential(
            nn.Sequential(nn.LazyLinear(8), nn.Dropout(0.5), _Counted()),
            nn.Linear(8, 1)), '0')
    x = _inputs(6, 4)
    for model in (plain, ckpt):
        torch.manual_seed(7)
        for _ in range(2):
            model(x).pow(2).sum().backward()
    _assert_same(plain, ckpt)
    # the first call made the weights unchecked, the second was checkpointed
    assert plain[0][2].calls == 2 and ckpt[0][2].calls == 3


class _RebindsItsInputs(nn.Module):
    """An FPN-style neck that rebinds the entries of the list it is given
    (``feats[i] = lateral(feats[i])``)."""

    def __init__(self):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(4, 4, 1) for _ in range(2))

    def forward(self, feats):
        for i, lateral in enumerate(self.lateral):
            feats[i] = lateral(feats[i]).relu()
        return tuple(feats)


def test_neck_rebinding_the_entries_of_its_input_list_is_exact():
    # the recompute ran on the rebound list: every gradient differed
    torch.manual_seed(0)
    plain, ckpt = _plain_and_checkpointed(
        nn.ModuleDict(
            dict(backbone=nn.Conv2d(3, 4, 1), neck=_RebindsItsInputs())),
        'neck')
    x = _inputs(2, 3, 8, 8)
    lists = []
    for model in (plain, ckpt):
        f = model['backbone'](x)
        feats = [f, f[:, :, ::2, ::2]]
        outs = model['neck'](feats)
        lists.append(feats)
        sum(o.pow(2).sum() for o in outs).backward()
    _assert_same(plain, ckpt)
    # the caller's list is rebound as in the plain model
    assert all(torch.equal(a, b) for a, b in zip(*lists))
    assert lists[1][0].grad_fn is not None and lists[1][0] is not f


class _ScaledScores(nn.Module):
    """Attention scores scaled in place: ``q @ k^T`` of 4-D tensors is a
    bmm whose output comes back through ``_unsafe_view``, an alias with a
    version counter of its own."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def scores(self, q, k):
        return (q @ k.transpose(-2, -1)).mul_(0.5)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        scores = self.scores(q, k)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)


@pytest.mark.parametrize('make, policy', [
    (_ScaledScores, 'save_matmuls'),
    (lambda: nn.Sequential(
        nn.Linear(8, 16, bias=False), nn.SiLU(inplace=True), nn.Linear(16, 8)),
     'save_compute_heavy'),
    (lambda: nn.GRU(8, 8, batch_first=True), ['addmm']),
])
@pytest.mark.needs_selective_checkpointing
def test_kept_output_written_through_an_unsafe_alias_is_exact(make, policy):
    # the write went through an alias whose version counter is its own, so
    # the kept output's did not move: the recompute read the written value
    # and wrote it again (other gradients, silently; found by a review).
    # Refused since; now the kept output is copied before the write
    torch.manual_seed(0)
    plain, ckpt = _plain_and_checkpointed(nn.Sequential(make()), '0', policy)
    for model in (plain, ckpt):
        out = model(_inputs(2, 4, 8))
        out = out[0] if isinstance(out, tuple) else out  # GRU: (out, h)
        out.square().sum().backward()
    _assert_same(plain, ckpt)


@pytest.mark.needs_selective_checkpointing
def test_unsafe_alias_of_an_output_not_kept_is_exact():
    # a 3-D matmul whose output is recomputed (save_convolutions keeps no
    # matmul): written in place through its alias, as in the plain model
    torch.manual_seed(0)
    plain, ckpt = _plain_and_checkpointed(
        nn.Sequential(_ScaledScores()), '0', 'save_convolutions')
    for model in (plain, ckpt):
        model(_inputs(2, 4, 8)).square().sum().backward()
    _assert_same(plain, ckpt)


@pytest.mark.needs_selective_checkpointing
def test_kept_output_returned_through_an_unsafe_alias_then_written():
    # a 3-D Linear without bias returns its kept mm output through
    # _unsafe_view; an in-place activation after the module returned wrote
    # it unseen: refused when backward would recompute
    model = nn.Sequential(
        nn.Linear(8, 16, bias=False), nn.SiLU(inplace=True), nn.Linear(16, 8))
    apply_activation_checkpointing(model, '0', 'save_matmuls')
    loss = model(_inputs(2, 4, 8)).square().sum()
    with pytest.raises(MmdtrError, match='after the module returned'):
        loss.backward()


class _KeepsItsScores(_ScaledScores):
    """Keeps its attention scores, unscaled, for the caller (``self.kept``):
    an ``_unsafe_view`` alias of the kept bmm output, never returned."""

    def scores(self, q, k):
        self.kept = q @ k.transpose(-2, -1)
        return self.kept


@pytest.mark.needs_selective_checkpointing
def test_kept_output_written_through_an_alias_the_module_keeps():
    # the caller scaled the scores the module kept, through an alias with
    # a version counter of its own, after the module returned: the
    # recompute read the written value (other gradients, silently; found
    # by a review and documented as unseen until now)
    model = nn.Sequential(_KeepsItsScores())
    apply_activation_checkpointing(model, '0', 'save_matmuls')
    loss = model(_inputs(2, 4, 8)).square().sum()
    model[0].kept.mul_(2)
    with pytest.raises(MmdtrError, match='after the module returned'):
        loss.backward()


@pytest.mark.needs_selective_checkpointing
def test_an_alias_the_module_keeps_and_nobody_writes_is_exact():
    torch.manual_seed(0)
    plain, ckpt = _plain_and_checkpointed(
        nn.Sequential(_KeepsItsScores()), '0', 'save_matmuls')
    for model in (plain, ckpt):
        model(_inputs(2, 4, 8)).square().sum().backward()
    _assert_same(plain, ckpt)
    assert torch.equal(plain[0].kept, ckpt[0].kept)


class _HoldsAnUnusedLazyLayer(nn.Module):

    def __init__(self, use_lazy_at=None):
        super().__init__()
        self.fc, self.spare, self.act = nn.Linear(4, 4), nn.LazyLinear(4), \
            _Counted()
        self.calls, self.use_lazy_at = 0, use_lazy_at

    def forward(self, x):
        self.calls += 1
        x = self.act(self.fc(x))
        return self.spare(x) if self.calls == self.use_lazy_at else x


def test_a_lazy_layer_never_called_does_not_stop_checkpointing():
    # every call ran without checkpoint while it stayed unmade (found by a
    # review): only the first does now
    plain, ckpt = _plain_and_checkpointed(
        nn.Sequential(_HoldsAnUnusedLazyLayer()), '0')
    for model in (plain, ckpt):
        for _ in range(3):
            model(_inputs(2, 4)).square().sum().backward()
    _assert_same(plain[0].fc, ckpt[0].fc)  # the spare one is never made
    assert ckpt[0].act.calls == 3 + 2  # two calls recomputed


def test_a_lazy_layer_made_in_a_checkpointed_call_is_refused():
    model = nn.Sequential(_HoldsAnUnusedLazyLayer(use_lazy_at=2))
    apply_activation_checkpointing(model, '0')
    model(_inputs(2, 4)).square().sum().backward()
    with pytest.raises(MmdtrError, match='made a lazy parameter'):
        model(_inputs(2, 4))
