"""Static facts about ops (mmdtr/core/op_semantics.py), checked against
what eager PyTorch does."""
import platform
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from mmdtr.core.engine import EngineState
from mmdtr.core.op_semantics import (ALWAYS, IN_DETERMINISTIC_MODE, NEVER,
                                     _cpu_classes, op_info,
                                     replayed_conv_may_change_kernel,
                                     same_bits_on_replay)
from mmdtr.core.policies import build_policy
from mmdtr.dtr import DTR

A = torch.ops.aten
_OTHER_CONV_KERNELS = replayed_conv_may_change_kernel(platform.machine())


def _three():
    return [torch.randn(3) for _ in range(2)]


def _bn_args():
    return (torch.randn(4, 3,
                        5), torch.ones(3), torch.zeros(3), torch.zeros(3),
            torch.ones(3), True, 0.1, 1e-5), {}


# (op, () -> (args, kwargs), indices of the arguments it writes without
# returning them)
CASES = {
    'native_batch_norm': (A.native_batch_norm.default, _bn_args, [3, 4]),
    '_native_batch_norm_legit':
    (A._native_batch_norm_legit.default, _bn_args, [3, 4]),
    'rrelu_with_noise': (A.rrelu_with_noise.default, lambda: (
        (torch.randn(4, 3), torch.empty(4, 3), 0.1, 0.3, True), {}), [1]),
    '_fused_sgd_': (A._fused_sgd_.default, lambda:
                    ((_three(), _three(), []),
                     dict(
                         weight_decay=0.,
                         momentum=0.,
                         lr=0.1,
                         dampening=0.,
                         nesterov=False,
                         maximize=False,
                         is_first_step=True)), [0, 1]),
    '_fused_adam_': (A._fused_adam_.default, lambda:
                     ((_three(), _three(), _three(), _three(), [],
                       [torch.tensor(1.), torch.tensor(1.)]),
                      dict(
                          lr=0.1,
                          beta1=0.9,
                          beta2=0.99,
                          weight_decay=0.,
                          eps=1e-8,
                          amsgrad=False,
                          maximize=False)), [0, 1, 2, 3]),
    '_amp_foreach_non_finite_check_and_unscale_':
    (A._amp_foreach_non_finite_check_and_unscale_.default, lambda:
     ((_three(), torch.zeros(1), torch.full((1, ), 0.5)), {}), [0, 1]),
    '_foreach_add_': (A._foreach_add_.List, lambda:
                      ((_three(), _three()), {}), [0]),
    '_foreach_copy_': (A._foreach_copy_.default, lambda:
                       ((_three(), _three()), {}), [0]),
}


@pytest.mark.parametrize('name', list(CASES))
def test_writes_not_returned_are_side_effects(name):
    # what an op writes without returning it is found from its schema (or,
    # for batch norm, from its name): readers are frozen first, replays get
    # scratch copies (R6, R7)
    func, make_args, written = CASES[name]
    args, kwargs = make_args()
    tensors = [
        t for i in written
        for t in (args[i] if isinstance(args[i], list) else [args[i]])
    ]
    before = [t.clone() for t in tensors]
    func(*args, **kwargs)
    assert any(not torch.equal(t, b) for t, b in zip(tensors, before))
    assert set(written) <= set(op_info(func).side_effect_args)


@pytest.mark.parametrize('name', list(CASES))
def test_versions_move_under_dtr_as_in_eager(name):
    # below a dispatch mode, in-place _foreach_ kernels leave the version
    # counters as they were; eager bumps them, and so does the engine now
    # (the saved-tensor check reads them, R10)
    func, make_args, written = CASES[name]
    moved = []
    for under_dtr in (False, True):
        args, kwargs = make_args()
        tensors = [
            t for i in written
            for t in (args[i] if isinstance(args[i], list) else [args[i]])
        ]
        before = [t._version for t in tensors]
        with DTR(eviction_threshold='1GB') if under_dtr else nullcontext():
            func(*args, **kwargs)
        moved.append([t._version - v for t, v in zip(tensors, before)])
    assert moved[0] == moved[1]


@pytest.mark.parametrize('op, cpu, cuda', [
    (A.mm.default, ALWAYS, ALWAYS),
    (A.convolution.default, NEVER if _OTHER_CONV_KERNELS else ALWAYS, ALWAYS),
    (A.convolution_backward.default, ALWAYS, IN_DETERMINISTIC_MODE),
    (A.index_add.default, ALWAYS, IN_DETERMINISTIC_MODE),
    (A.index_add_.default, ALWAYS, IN_DETERMINISTIC_MODE),
    (A.scatter_add.default, ALWAYS, IN_DETERMINISTIC_MODE),
    (A.scatter.src, ALWAYS, IN_DETERMINISTIC_MODE),
    (A.scatter.reduce, ALWAYS, NEVER), (A.scatter_reduce.two, ALWAYS, NEVER),
    (A.index_reduce.default, ALWAYS, NEVER),
    (A.index_put_.default, IN_DETERMINISTIC_MODE, IN_DETERMINISTIC_MODE),
    (A.index_copy.default, IN_DETERMINISTIC_MODE, IN_DETERMINISTIC_MODE),
    (A.put_.default, NEVER, NEVER), (A.histc.default, ALWAYS, NEVER),
    (A.kthvalue.default, ALWAYS, NEVER),
    (A.nll_loss2d_forward.default, ALWAYS, NEVER),
    (A.linalg_lstsq.default, NEVER, NEVER)
])
def test_determinism_of_ops(op, cpu, cuda):
    # PyTorch tags no aten op nondeterministic_bitwise: read from the tag,
    # index_add, scatter_add, index_put and the rest counted as
    # deterministic
    info = op_info(op)
    assert (info.cpu_determinism, info.cuda_determinism) == (cpu, cuda)


def test_convolutions_are_kept_where_a_replay_may_take_another_kernel():
    # a replay's arguments require no grad: on ARM and RISC-V builds PyTorch
    # may run a replayed convolution on its inference-only Winograd kernel
    # (found by an adversarial search). XNNPACK, built into PyTorch's x86
    # wheels, runs convolutions on mobile builds only: x86 convolutions
    # replay (keyed on XNNPACK, they were kept on an official x86 wheel)
    for machine in ('aarch64', 'arm64', 'armv7l', 'riscv64'):
        assert replayed_conv_may_change_kernel(machine), machine
    for machine in ('x86_64', 'AMD64', 'i686', 'ppc64le', 's390x'):
        assert not replayed_conv_may_change_kernel(machine), machine
    kept, replayed = _cpu_classes(True), _cpu_classes(False)
    for name in ('convolution', '_convolution', 'convolution_overrideable'):
        assert kept[name] == NEVER and name not in replayed
    assert {
        k: v
        for k, v in kept.items() if 'convolution' not in k
    } == replayed


@pytest.mark.parametrize('metered_cuda', [False, True])
@pytest.mark.parametrize('deterministic', [False, True])
def test_keeps_what_a_replay_would_compute_other_bits_of(
        metered_cuda, deterministic, deterministic_algorithms):
    # index_put with duplicate indices writes them in any order, also on
    # CPU: a rebuild of its output gave a gradient of another loss (R4).
    # The CPU kernels' classes decide for CPU ops also where the engine
    # meters CUDA (it took the metered device's classes: a CUDA op in a
    # scope metered on CPU was judged by CPU kernels; found by a review)
    state = EngineState(1, 1, False, build_policy('dtr'), 'cpu')
    if metered_cuda:
        state.cuda = True
        state.start_cuda_meter(SimpleNamespace(read=lambda: 0, peak=0))
    x = torch.randn(64, 8, requires_grad=True)
    index = torch.randint(0, 4, (64, ))

    def creator(op, *args):
        with state.lock:  # as the dispatch mode calls it (R12)
            out = state.on_op(op, args, {})
        return state.records[out.untyped_storage()._cdata].creator

    with deterministic_algorithms(enabled=deterministic):
        assert creator(A.mul.Tensor, x, x) is not None
        assert creator(A.index_add.default, torch.zeros(4, 8), 0, index,
                       x) is not None  # CUDA's kernel sums in any order
        put = creator(A.index_put.default, torch.zeros(4, 8), [index], x)
        assert (put is not None) == deterministic
        assert creator(A.histc.default, x.detach(), 8) is not None


@pytest.mark.parametrize('deterministic', [False, True])
def test_each_device_the_call_ran_on_decides_by_its_kernels(
        deterministic, deterministic_algorithms):
    # an atomics-based CUDA kernel sums in another order on each call
    index_add, mul = op_info(A.index_add.default), op_info(A.mul.Tensor)
    with deterministic_algorithms(enabled=deterministic):
        assert same_bits_on_replay(index_add, ['cpu'])
        assert same_bits_on_replay(index_add, ['cuda']) == deterministic
        assert same_bits_on_replay(index_add, ['cpu', 'cuda']) == deterministic
        assert not same_bits_on_replay(op_info(A.histc.default), ['cuda'])
        assert same_bits_on_replay(op_info(A.histc.default), ['cpu'])
        assert same_bits_on_replay(mul, ['cpu', 'cuda'])
        assert not same_bits_on_replay(mul, ['cpu', 'xpu'])  # unknown: kept
