"""InplaceOptimWrapper's AMP on CUDA, bit for bit against a hand-written
``torch.autocast`` + ``torch.amp.GradScaler`` loop and MMEngine's
``OptimWrapper`` under autocast.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_adapters/test_inplace_optim_cuda.py``. The
references step with the loop (``foreach=False``), as the wrapper does:
torch's CUDA default, foreach steps, may differ in the last bits.
"""
import pytest
import torch
from mmengine.optim import OptimWrapper

from mmdtr.adapters.inplace_optim_wrapper import InplaceOptimWrapper
from .test_inplace_optim_wrapper import TiedNet, scaled_steps

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason='needs CUDA')
CUDA = torch.device('cuda', 0)


def _tokens(i):
    return torch.randint(
        0, 16, (6, ), generator=torch.Generator().manual_seed(i)).to(CUDA)


def _build(wrapper_cls=None, **wrapper_kwargs):
    torch.manual_seed(0)
    model = TiedNet().to(CUDA)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    if wrapper_cls is None:
        return model, optimizer
    return model, wrapper_cls(optimizer=optimizer, **wrapper_kwargs)


def _train(model, wrapper, iters=4):
    for i in range(iters):
        with wrapper.optim_context(model):
            loss = model(_tokens(i))
        wrapper.update_params(loss)


def _assert_same(model_a, model_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(model_a.named_buffers(), model_b.buffers()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize('init_scale', [2.0**16, 2.0**40])
def test_float16_dynamic_scaling_matches_autocast_and_grad_scaler(init_scale):
    # 2**40 overflows float16 gradients: the first steps are skipped and the
    # scale backs off, as GradScaler's own
    ref, opt = _build()
    scaler = torch.amp.GradScaler('cuda', init_scale=init_scale)
    scaled_steps(ref, opt, scaler, ('cuda', torch.float16), _tokens, 4)
    model, wrapper = _build(
        InplaceOptimWrapper,
        clip_grad=dict(max_norm=0.05),
        amp=dict(dtype='float16', loss_scale=dict(init_scale=init_scale)))
    with wrapper.optim_context(model):
        assert model.body[0](torch.ones(1, 8, device=CUDA)).dtype \
            == torch.float16
    _train(model, wrapper)
    _assert_same(ref, model)
    assert wrapper.state_dict()['loss_scaler'] == scaler.state_dict()
    if init_scale > 2.0**16:
        assert scaler.get_scale() < init_scale  # the skip happened


def test_bfloat16_in_backward_matches_optim_wrapper():
    ref, ref_wrapper = _build(OptimWrapper)
    for i in range(4):
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = ref(_tokens(i))
        ref_wrapper.update_params(loss)
    model, wrapper = _build(
        InplaceOptimWrapper,
        step_in_backward=True,
        amp=dict(dtype='bfloat16', loss_scale=None))
    _train(model, wrapper)
    _assert_same(ref, model)
    assert all(p.grad is None for p in model.parameters())
