"""Shared test fixtures: the bit-exactness oracles of the DTR engine."""
import contextlib
import copy
import os

import pytest
import torch
from torch.torch_version import TorchVersion

from mmdtr.adapters.checkpoint_loading import WEIGHTS_ONLY_BY_DEFAULT
from mmdtr.core import torch_compat
from mmdtr.dtr import DTR

# cuBLAS reads this when its handle is made: before any CUDA matmul
os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')

_NO_SELECTIVE = torch_compat.create_selective_checkpoint_contexts is None
_NO_HOOKS_READER = torch_compat._top_hooks is None
#: marker -> (whether this PyTorch lacks it, why the test is skipped)
_NEEDS = {
    'needs_selective_checkpointing':
    (_NO_SELECTIVE, 'selective checkpointing needs PyTorch >= 2.5'),
    'needs_hooks_on_top':
    (_NO_HOOKS_READER,
     'PyTorch before 2.8 cannot name the saved-tensor hooks in force'),
    'needs_weights_only_default':
    (not WEIGHTS_ONLY_BY_DEFAULT,
     'torch.load loads weights only by default from PyTorch 2.6'),
}

_TORCH = TorchVersion(torch.__version__)


def pytest_configure(config):
    for name, (_, why) in _NEEDS.items():
        config.addinivalue_line('markers', f'{name}: skipped unless {why}')
    config.addinivalue_line(
        'markers', 'fails_before_torch(version, reason): a known gap on '
        'older PyTorch (docs/status.md), expected to fail there (strict)')


def pytest_collection_modifyitems(config, items):
    """Skip what the PyTorch installed lacks (mmdtr runs on >= 2.4), and
    expect the known gaps of older releases to fail."""
    for item in items:
        for name, (missing, why) in _NEEDS.items():
            if missing and item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=why))
        gap = item.get_closest_marker('fails_before_torch')
        if gap is not None and _TORCH < gap.args[0]:
            item.add_marker(
                pytest.mark.xfail(strict=True, reason=gap.kwargs['reason']))


def _state(model):
    return ({
        n: p.grad
        for n, p in model.named_parameters()
    }, dict(model.named_buffers()))


def assert_bit_identical(model_a, model_b, loss_a, loss_b):
    """Loss, every gradient and every buffer equal, bit for bit."""
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    grads_a, bufs_a = _state(model_a)
    grads_b, bufs_b = _state(model_b)
    for name, g in grads_a.items():
        h = grads_b[name]
        assert (g is None) == (h is None), name
        assert g is None or torch.equal(g, h), f'gradient of {name} differs'
    for name, b in bufs_a.items():
        assert torch.equal(b, bufs_b[name]), f'buffer {name} differs'


def _rng_states(device):
    states = [torch.get_rng_state()]
    if device.type == 'cuda':
        states.append(torch.cuda.get_rng_state(device))
    return states


class Oracle:
    """Runs ``step(model)`` without DTR and under DTR, and compares.

    ``step(model) -> loss`` must do forward and backward, with its inputs on
    the model's device. Both runs start from deep copies of the same model
    (moved to ``device``) and the same RNG state (CPU and CUDA).
    """

    def __init__(self, model, step, seed=0, device='cpu'):
        self.device = torch.device(device)
        self.model, self.step, self.seed = model.to(self.device), step, seed
        self.baseline_model = copy.deepcopy(self.model)
        torch.manual_seed(seed)
        self.baseline_loss = step(self.baseline_model)
        self.rng_after = _rng_states(self.device)
        probe = copy.deepcopy(self.model)
        torch.manual_seed(seed)
        with DTR(eviction_threshold=2**62, evictee_minimum_size=1) as e:
            step(probe)
        #: the engine's meter of the step with nothing evicted (CUDA:
        #: ``memory_allocated``, the models included)
        self.baseline_peak = e.stats.peak_memory

    def run(self, threshold, **kwargs):
        """Run under DTR at ``threshold`` bytes; assert bit-identity."""
        model = copy.deepcopy(self.model)
        torch.manual_seed(self.seed)
        kwargs.setdefault('evictee_minimum_size', 1)
        with DTR(
                eviction_threshold=max(int(threshold), 1), **kwargs) as engine:
            loss = self.step(model)
        assert_bit_identical(self.baseline_model, model, self.baseline_loss,
                             loss)
        # recomputation never shifts the global RNG streams
        for a, b in zip(_rng_states(self.device), self.rng_after):
            assert torch.equal(a, b)
        return engine.stats


@pytest.fixture(scope='session')
def _default_scopes_at_start():
    from mmengine.registry import DefaultScope
    return DefaultScope, DefaultScope._instance_dict.copy()


@pytest.fixture(autouse=True)
def _default_scope_as_at_start(_default_scopes_at_start):
    """Each test starts and ends with MMEngine's default scope as the
    session started with it.

    A Runner makes itself a default scope (``'mmengine'`` for a config
    without ``default_scope``) that outlives it, also when a module or
    session fixture built it; a later test's bare type names
    (``DATASETS.build(dict(type='SyntheticTokenDataset'))``) then resolve in
    MMEngine's root registries, and fail, depending on which tests ran
    before in the same process (seen under pytest-xdist). The instances are
    restored the way ``DefaultScope.overwrite_default_scope`` restores them.
    """
    scope, at_start = _default_scopes_at_start
    scope._instance_dict = at_start.copy()
    yield
    scope._instance_dict = at_start.copy()


@pytest.fixture
def oracle():
    return Oracle


@contextlib.contextmanager
def _deterministic_algorithms(enabled=True, warn_only=False):
    """Deterministic algorithms (bit-exactness on CUDA needs them), or
    not (``enabled=False``); both flags of
    ``torch.use_deterministic_algorithms`` restored afterwards."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def deterministic_algorithms():
    """:func:`_deterministic_algorithms`: ``with ...(enabled=True,
    warn_only=False):``."""
    return _deterministic_algorithms


@pytest.fixture
def deterministic():
    """Deterministic algorithms for the test; restored afterwards."""
    with _deterministic_algorithms():
        yield


def _same_under_dtr(step, setup=None):
    """Run ``step`` plain, then under DTR with every storage evictable
    (threshold and minimum size of 1 byte), each after ``manual_seed(0)``;
    ``setup()``, if given, makes ``step``'s argument outside the scope.
    Every tensor ``step`` returns must be equal, bit for bit (NaNs equal).

    Returns:
        DTRStats: What the engine did.
    """
    results, stats = [], None
    for under_dtr in (False, True):
        torch.manual_seed(0)
        args = () if setup is None else (setup(), )
        if under_dtr:
            with DTR(eviction_threshold=1, evictee_minimum_size=1) as engine:
                results.append(step(*args))
            stats = engine.stats
        else:
            results.append(step(*args))
    for a, b in zip(*results):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    return stats


@pytest.fixture
def same_under_dtr():
    """:func:`_same_under_dtr`: a step's tensors without and under DTR."""
    return _same_under_dtr


def _refused_like_eager(step, match='modified by an inplace'):
    """``step()`` raises a ``RuntimeError`` matching ``match`` plain and
    under DTR with every storage evictable, as eager autograd does."""
    for under_dtr in (False, True):
        torch.manual_seed(0)
        with pytest.raises(RuntimeError, match=match):
            if under_dtr:
                with DTR(eviction_threshold=1, evictee_minimum_size=1):
                    step()
            else:
                step()


@pytest.fixture
def refused_like_eager():
    """:func:`_refused_like_eager`: a step eager refuses, refused by DTR."""
    return _refused_like_eager


@pytest.fixture
def dynamo_compiles():
    """Skips where dynamo compiles nothing in this process: before PyTorch
    2.11, a thread that ended inside a dispatch mode turns it off for the
    whole process (PyTorch's own: a bare ``TorchDispatchMode`` does it on
    2.6, 2.8 and 2.10), and earlier tests end threads inside DTR on
    purpose. Run alone, these tests compile there."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.compile(lambda x: x + 1, backend='eager')(torch.zeros(1))
    if not counters['frames']['ok']:
        pytest.skip(f'dynamo of PyTorch {torch.__version__} is off in this '
                    'process (as after a thread ended inside a dispatch mode)')
    torch._dynamo.reset()
