"""Replay settings: a replay runs outside vmap and inference mode as the
original did, captures the generator of the device a random op draws on,
replays copies blocking, and builds no autograd graph."""
import pytest
import torch

from mmdtr.dtr import DTR


def _dropout_graph():
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    h = torch.nn.functional.dropout(x @ w, 0.3)
    return x, (h * h).tanh()  # mul saves the dropout output


def _under_dtr(step):
    with DTR(eviction_threshold=1, evictee_minimum_size=0) as engine:
        out = step()
    assert engine.stats.recomputations > 0
    return out


@pytest.mark.parametrize('how', [
    'is_grads_batched',
    pytest.param(
        'torch.func.vmap',
        marks=pytest.mark.fails_before_torch(
            (2, 5),
            reason='torch.func refuses saved-tensor hooks on PyTorch 2.4'))
])
def test_a_backward_under_vmap_replays_outside_it(how):
    # the replayed dropout ran inside vmap, which refuses random ops (or
    # batches them): a RuntimeError where eager runs (found by an
    # adversarial search)
    def step():
        x, y = _dropout_graph()
        basis = torch.eye(32).view(32, 4, 8)
        if how == 'is_grads_batched':
            return torch.autograd.grad(y, x, basis, is_grads_batched=True)[0]

        def vjp(v):
            return torch.autograd.grad(y, x, v, retain_graph=True)[0]

        return torch.func.vmap(vjp, randomness='different')(basis)

    expected = step()
    assert torch.equal(_under_dtr(step), expected)


def test_a_backward_in_inference_mode_rebuilds_normal_tensors():
    # the rebuilt views were inference tensors, whose version the engine
    # reads: a RuntimeError where eager runs (found by an adversarial search)
    def step():
        x, y = _dropout_graph()
        loss = y.exp().sum()
        del y
        with torch.inference_mode():
            loss.backward()
        return x.grad

    expected = step()
    assert torch.equal(_under_dtr(step), expected)


def test_a_random_op_given_a_device_captures_that_devices_generator(
        monkeypatch):
    # randint_like(cpu_t, 10, device='cuda') draws on CUDA: the first
    # tensor's device was taken over the keyword, so the CPU's state was
    # captured and the rebuild drew other numbers; and an unindexed 'cuda'
    # was resolved again at each use (found by a review of the CUDA paths)
    from mmdtr.core.replay import Replayer
    asked = []
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 1)
    monkeypatch.setattr(torch.cuda, 'get_rng_state',
                        lambda device: asked.append(device) or 'state')
    t = torch.randn(4)
    for given in ('cuda', torch.device('cuda', 1)):
        gen, state = Replayer._capture_rng((t, 10), {'device': given})
        assert gen == ('cuda', torch.device('cuda', 1)) and state == 'state'
    assert asked == [torch.device('cuda', 1)] * 2
    gen, _ = Replayer._capture_rng((t, ), {})
    assert gen is None  # the CPU's default generator


def test_copies_are_replayed_blocking(monkeypatch):
    # a device-to-host copy replayed with non_blocking=True may not have
    # landed when the rebuilt tensor is read (found by a review of the
    # CUDA paths); on CPU the flag changes nothing but what is asked
    from mmdtr.core.engine import EngineState
    asked, run = [], EngineState._run

    def spy(self, func, args, kwargs, rng=None, unlocked=False):
        if func is torch.ops.aten._to_copy.default and not unlocked:
            asked.append(kwargs.get('non_blocking'))  # a replay
        return run(self, func, args, kwargs, rng, unlocked)

    def step(x):
        h = x
        for _ in range(3):
            h = h.to(torch.float64, non_blocking=True).tanh()
            h = h.to(torch.float32, non_blocking=True)
        h.sum().backward()

    x = torch.randn(64, 64, requires_grad=True)
    expected = x.detach().clone().requires_grad_()
    step(expected)
    monkeypatch.setattr(EngineState, '_run', spy)
    with DTR(eviction_threshold=1, evictee_minimum_size=0) as engine:
        step(x)
    assert engine.stats.recomputations > 0 and asked
    assert not any(asked)
    assert torch.equal(x.grad, expected.grad)


def test_a_replay_builds_no_graph(monkeypatch):
    # its arguments are detached aliases: replayed with a parameter that
    # requires grad, the op built a graph nobody backpropagates (an audit:
    # a mutant passing them as they are lived)
    from mmdtr.core.engine import EngineState
    replayed, run = [], EngineState._run

    def spy(self, func, args, kwargs, rng=None, unlocked=False):
        out = run(self, func, args, kwargs, rng, unlocked)
        if self.rebuilding is not None:  # inside a rebuild
            outs = out if isinstance(out, (tuple, list)) else (out, )
            replayed.extend(
                t.requires_grad for t in outs if isinstance(t, torch.Tensor))
        return out

    monkeypatch.setattr(EngineState, '_run', spy)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with DTR(eviction_threshold=3 * x.nbytes, evictee_minimum_size=1):
        h = x
        for _ in range(12):
            h = lin(h).tanh()
        h.sum().backward()
    assert replayed and not any(replayed)
