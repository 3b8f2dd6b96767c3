import math

import pytest
import torch
import torch.nn.functional as F

from mmdtr.errors import MmdtrError
from mmdtr.models import GPTDecoder
from mmdtr.registry import MODELS

TINY = dict(
    vocab_size=97, max_seq_len=16, num_layers=2, num_heads=2, embed_dims=32)


def _tokens(n, t, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (n, t), generator=g)


def test_build_from_registry_with_defaults():
    model = MODELS.build(dict(type='GPTDecoder'))
    assert len(model.blocks) == 4 and model.max_seq_len == 128
    assert model.token_embedding.weight.shape == (8192, 256)


def test_output_projection_is_tied_to_the_token_embedding():
    model = GPTDecoder(**TINY)
    assert model.lm_head.weight is model.token_embedding.weight
    names = [name for name, _ in model.named_parameters()]
    assert 'lm_head.weight' not in names  # counted once


def test_modes_shapes_and_loss_value():
    model = GPTDecoder(**TINY).eval()
    inputs, targets = _tokens(3, 10), _tokens(3, 10, seed=1)
    logits = model(inputs, mode='tensor')
    assert logits.shape == (3, 10, 97)
    loss = model(inputs, targets, mode='loss')
    assert set(loss) == {'loss'}
    expected = F.cross_entropy(logits.reshape(-1, 97), targets.reshape(-1))
    torch.testing.assert_close(loss['loss'], expected)
    preds = model(inputs, targets, mode='predict')
    assert len(preds) == 3
    assert torch.equal(preds[1]['pred_tokens'], logits[1].argmax(-1))
    assert torch.equal(preds[1]['gt_tokens'], targets[1])


def test_loss_at_init_is_near_uniform():
    model = GPTDecoder(**TINY).train()
    loss = model(_tokens(4, 16), _tokens(4, 16, seed=2), mode='loss')
    assert abs(loss['loss'].item() - math.log(97)) < 0.3


def test_attention_is_causal():
    model = GPTDecoder(**TINY).eval()
    tokens = _tokens(1, 12)
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 97
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_loss_without_targets_predicts_the_shifted_inputs():
    model = GPTDecoder(**TINY).eval()
    sequence = _tokens(2, 13)
    implicit = model(sequence, mode='loss')['loss']
    explicit = model(sequence[:, :-1], sequence[:, 1:], mode='loss')['loss']
    torch.testing.assert_close(implicit, explicit)


def test_dropout_only_in_training():
    model = GPTDecoder(**TINY)
    tokens = _tokens(2, 8)
    model.train()
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    no_dropout = GPTDecoder(
        **TINY, embed_dropout=0, attn_dropout=0, resid_dropout=0).train()
    assert torch.equal(no_dropout(tokens), no_dropout(tokens))


def test_gradients_reach_every_parameter():
    model = GPTDecoder(**TINY).train()
    model(_tokens(2, 16), _tokens(2, 16, seed=3), mode='loss')['loss'] \
        .backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_a_few_steps_fit_a_fixed_batch():
    torch.manual_seed(0)
    model = GPTDecoder(
        **TINY, embed_dropout=0, attn_dropout=0, resid_dropout=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, targets = _tokens(4, 16), _tokens(4, 16, seed=4)
    losses = []
    for _ in range(30):
        loss = model(inputs, targets, mode='loss')['loss']
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_bad_arguments_and_inputs_raise():
    with pytest.raises(MmdtrError, match='divisible'):
        GPTDecoder(embed_dims=30, num_heads=4)
    with pytest.raises(MmdtrError, match='num_layers'):
        GPTDecoder(num_layers=0)
    with pytest.raises(MmdtrError, match='num_layers must be a positive'):
        GPTDecoder(num_layers=True)
    for key in ('embed_dropout', 'attn_dropout', 'resid_dropout'):
        with pytest.raises(MmdtrError, match=f'GPTDecoder {key}'):
            GPTDecoder(**{key: 2.0})
    model = GPTDecoder(**TINY)
    with pytest.raises(MmdtrError, match='max_seq_len=16'):
        model(_tokens(1, 17))
    with pytest.raises(MmdtrError, match='int64'):
        model(_tokens(1, 4).float())
    with pytest.raises(MmdtrError, match='must match'):
        model(_tokens(1, 4), _tokens(1, 5), mode='loss')
    with pytest.raises(MmdtrError, match='mode'):
        model(_tokens(1, 4), mode='generate')
