"""Static facts about ops (mmdtr/core/op_semantics.py), checked against
what eager PyTorch does."""
from contextlib import nullcontext

import pytest
import torch

from mmdtr.core.op_semantics import op_info
from mmdtr.dtr import DTR

A = torch.ops.aten


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
