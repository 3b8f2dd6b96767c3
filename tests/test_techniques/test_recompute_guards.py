"""What a checkpointed module's recompute may not change a second time, and
what it reads that must not change before it (``recompute_guards``): each
case is refused with an MmdtrError, or shown bit-identical where nothing is
wrong."""
import copy

import pytest
import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.techniques.activation_checkpointing import \
    apply_activation_checkpointing


class _WritesAContainedInput(nn.Module):
    """An FPN-style neck: takes a list (or a dict) of features and writes
    one in place."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, feats):
        f = feats[0] if isinstance(feats, list) else feats['x']
        return self.linear(f.mul_(2)).tanh()


@pytest.mark.parametrize('container', [list, dict])
def test_module_writing_an_input_inside_a_container_is_refused(container):
    # found by an adversarial search: only top-level tensor arguments were
    # checked, so the gradients silently differed from the plain run
    class Net(nn.Module):

        def __init__(self):
            super().__init__()
            self.stem, self.neck = nn.Linear(8, 8), _WritesAContainedInput()

        def forward(self, x):
            f = self.stem(x)
            return self.neck([f] if container is list else dict(x=f)).sum()

    model = Net()
    apply_activation_checkpointing(model, 'neck')
    with pytest.raises(MmdtrError, match='writes its input in place'):
        model(torch.randn(4, 8))


class _WritesItsInput(nn.Module):

    def forward(self, x):
        return x.mul_(2).sin()


@pytest.mark.parametrize('make',
                         [lambda: nn.ReLU(inplace=True), _WritesItsInput])
def test_module_writing_its_input_is_refused(make):
    # the recompute read the written input: autograd's in-place error in
    # backward, from PyTorch's own checkpoint too (found by an adversarial
    # search: 'backbone.layer1.*.*' selects ResNet's in-place ReLUs)
    model = nn.Sequential(nn.Linear(8, 8), make(), nn.Linear(8, 1))
    apply_activation_checkpointing(model, '1')
    # which module, by the name it was selected by (a glob selects many)
    with pytest.raises(
            MmdtrError,
            match=f"{type(model[1]).__name__} '1' writes its "
            'input in place'):
        model(torch.randn(4, 8))
    with torch.no_grad():  # no checkpoint, no recompute: as it is
        model(torch.randn(4, 8))


class _EmaScale(nn.Module):
    """Scales by an EMA of its input's magnitude, updated in forward."""

    def __init__(self, replace=False):
        super().__init__()
        self.replace = replace
        self.register_buffer('scale', torch.ones(8))
        self.register_buffer('calls', torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = x * self.scale.clone()
        with torch.no_grad():
            if self.replace:  # a new tensor, no version bump
                self.calls = self.calls + 1
            else:
                self.scale.mul_(0.5).add_(0.5 * x.abs().mean(0))
        return out


@pytest.mark.parametrize('replace', [False, True])
def test_module_updating_a_buffer_is_refused(replace):
    # the recompute read the updated buffer (other gradients) and updated
    # it again (found by an adversarial search); BatchNorm's statistics are
    # guarded, so a block with both is refused for the other buffer only
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Sequential(nn.BatchNorm1d(8), _EmaScale(replace)),
        nn.Linear(8, 1))
    apply_activation_checkpointing(model, '1')
    name = '_EmaScale.calls' if replace else '_EmaScale.scale'
    with pytest.raises(MmdtrError, match=f'updates the buffer {name}'):
        model(torch.randn(4, 8))
    model[1][1] = nn.Identity()  # BatchNorm alone: checkpointed as usual
    model(torch.randn(4, 8)).sum().backward()


class _ReadsASharedWeight(nn.Module):
    """Reads a weight of a shared module through ``.detach()``: no
    gradient flows to it from here, so a step in backward may come first."""

    def __init__(self, shared):
        super().__init__()
        self.fc, self.shared = nn.Linear(8, 8), shared

    def forward(self, x):
        return torch.tanh(self.fc(x) * self.shared.weight.detach().sum())


def test_parameter_written_before_the_recompute_is_refused():
    # InplaceOptimWrapper(step_in_backward=True) stepped the shared weight
    # (its gradient complete) before the block recomputed: the recompute
    # read the new weight and every gradient differed, silently (found by
    # an adversarial search)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(_ReadsASharedWeight(shared))
    apply_activation_checkpointing(model, '0')
    loss = model(torch.randn(4, 8)).sum()
    with torch.no_grad():
        shared.weight.add_(1.0)  # what the step in backward does
    with pytest.raises(
            MmdtrError,
            match='written in place or replaced between its '
            'forward and its recomputation'):
        loss.backward()
    loss = model(torch.randn(4, 8)).sum()  # unchanged since: it runs
    loss.backward()


@pytest.mark.parametrize('calls', [1, 2])
def test_parameter_written_by_the_forward_itself_is_not_refused(calls):
    # Embedding(max_norm=...) renormalizes its weight in the forward, and
    # again, to the same values, in each recompute (twice: retain_graph);
    # called twice, the first call's recompute sees the versions the second
    # call moved (found by a review)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 4))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, '*')
    grads = []
    for net in (plain, model):
        ids = torch.tensor([1, 2, 3])
        out = net(ids).tanh()
        if calls == 2:
            out = out * net(ids + 1).tanh()
        out = out.sum()
        out.backward(retain_graph=True)
        out.backward()
        grads.append([p.grad for p in net.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_parameter_written_between_two_calls_is_refused():
    # the second call's forward refreshed the record the calls share, and
    # the first call's recompute read the new weight (found by a review)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    apply_activation_checkpointing(model, '0')
    x = torch.randn(2, 4)
    loss = model(x).sum()
    with torch.no_grad():
        model[0][0].weight.mul_(2)
    loss = loss + model(x).sum()
    with pytest.raises(
            MmdtrError,
            match='written in place or replaced between its '
            'forward and its recomputation'):
        loss.backward()


class _Shifted(nn.Module):
    """Adds a buffer: ``add`` saves nothing, so eager's gradients do not
    read it; a recompute does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer('shift', torch.zeros(4))

    def forward(self, x):
        return torch.tanh(self.fc(x) + self.shift)


def _shifted():
    block = _Shifted()
    return block, block, 'shift'


def _frozen_bn():
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    return block, block[1], 'running_mean'


@pytest.mark.parametrize('replace', [False, True], ids=['written', 'rebound'])
@pytest.mark.parametrize('make', [_shifted, _frozen_bn])
def test_buffer_changed_before_the_recompute_is_refused(make, replace):
    # the recompute read the new values: gradients off by up to 0.79 (a
    # shift), 10.9 (a frozen BN's statistics under efficient Conv-BN
    # eval), silently (found by an adversarial search; a buffer rebound,
    # not written, by a review)
    torch.manual_seed(0)
    block, owner, name = make()
    model = nn.Sequential(block)
    apply_activation_checkpointing(model, '0')
    loss = model(torch.randn(3, 4)).pow(2).sum()
    with torch.no_grad():
        if replace:
            setattr(owner, name, getattr(owner, name) + 0.5)
        else:
            getattr(owner, name).add_(0.5)
    with pytest.raises(
            MmdtrError,
            match=f"'{'1.' * (owner is not block)}"
            f"{name}' of a checkpointed"):
        loss.backward()
    loss = model(torch.randn(3, 4)).pow(2).sum()  # unchanged since: it runs
    loss.backward()


def test_statistics_a_shared_training_norm_updates_are_not_refused():
    # a block called twice updates its BN's statistics twice: its own
    # writes, which the recomputes do not read
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, '0')
    for net in (plain, model):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        (net(x).tanh() * net(x * 2).tanh()).sum().backward()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(plain.buffers(), model.buffers()):
        assert torch.equal(a, b)


class _ReadsItsNormStatistics(nn.Module):
    """Scales by the running variance its batch norm updates (as a
    BatchRenorm-style layer reads its statistics)."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.bn = nn.BatchNorm2d(3, momentum=momentum)

    def forward(self, x):
        scale = self.bn.running_var
        return self.bn(x) * scale[None, :, None, None]


@pytest.mark.parametrize('momentum', [0.1, None])
@pytest.mark.parametrize('retain', [False, True])
def test_forward_reading_running_statistics_is_exact(momentum, retain):
    # the recompute got copies of the statistics as the forward left them
    # (updated), and updated them again before reading: other gradients,
    # silently (found by a review). It starts from those the forward began
    # with now
    torch.manual_seed(0)
    plain = nn.Sequential(_ReadsItsNormStatistics(momentum))
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, '0')
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    for model in (plain, ckpt):
        for _ in range(2):
            loss = model(x * 2 + 1).square().sum()
            loss.backward(retain_graph=retain)
            if retain:  # a second backward recomputes again
                loss.backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    for b, c in zip(plain.buffers(), ckpt.buffers()):
        assert torch.equal(b, c)
