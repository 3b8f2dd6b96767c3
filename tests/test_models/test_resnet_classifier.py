import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.models import ResNet50Classifier, ResNetClassifier
from mmdtr.registry import MODELS


def _batch(num_classes, n=2, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, size, size, generator=g)
    labels = torch.randint(num_classes, (n, ), generator=g)
    return images, labels


@pytest.mark.parametrize('depth,num_params', [(18, 11_689_512),
                                              (50, 25_557_032)])
def test_parameter_count_matches_reference_architecture(depth, num_params):
    # the torchvision counts of ResNet-18/50 with 1000 classes
    model = MODELS.build(dict(type='ResNetClassifier', depth=depth))
    assert sum(p.numel() for p in model.parameters()) == num_params


def test_resnet50_alias_is_depth_50():
    model = MODELS.build(dict(type='ResNet50Classifier', num_classes=7))
    assert isinstance(model, ResNetClassifier)
    assert model.backbone.depth == 50
    with pytest.raises(MmdtrError, match='fixed depth'):
        ResNet50Classifier(depth=18)


def test_three_modes_shapes_and_consistency():
    model = ResNetClassifier(depth=50, num_classes=10).eval()
    images, labels = _batch(10, n=3)
    logits = model(images, mode='tensor')
    assert logits.shape == (3, 10)
    loss = model(images, labels, mode='loss')
    assert set(loss) == {'loss'} and loss['loss'].dim() == 0
    expected = nn.functional.cross_entropy(logits, labels)
    torch.testing.assert_close(loss['loss'], expected)
    preds = model(images, labels, mode='predict')
    assert len(preds) == 3
    for i, pred in enumerate(preds):
        assert pred['pred_label'] == logits[i].argmax()
        torch.testing.assert_close(pred['pred_score'].sum(), torch.tensor(1.))
        assert pred['gt_label'] == labels[i]
    assert 'gt_label' not in model(images, mode='predict')[0]


def test_gradients_reach_every_parameter():
    model = ResNetClassifier(depth=18, num_classes=5).train()
    images, labels = _batch(5, n=4)
    model(images, labels, mode='loss')['loss'].backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_blocks_use_inplace_relu_and_bn():
    model = ResNetClassifier(depth=50, num_classes=2)
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    assert relus and all(m.inplace for m in relus)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 53
    block = model.backbone.layer1[0]
    assert [type(m) for m in (block.bn1, block.bn2, block.bn3)] == \
        [nn.BatchNorm2d] * 3


def test_block_adds_identity_in_place():
    # with the residual branch zeroed the block is relu(x + 0) == relu(x)
    model = ResNetClassifier(depth=50, zero_init_residual=True).eval()
    block = model.backbone.layer1[1]
    assert torch.count_nonzero(block.bn3.weight) == 0
    x = torch.randn(1, 256, 8, 8)
    torch.testing.assert_close(block(x.clone()), torch.relu(x))


def test_loss_at_init_is_near_uniform():
    model = ResNetClassifier(depth=18, num_classes=100).train()
    images, labels = _batch(100, n=8)
    loss = model(images, labels, mode='loss')['loss'].item()
    assert abs(loss - math.log(100)) < 0.5


def test_bad_arguments_and_inputs_raise():
    with pytest.raises(MmdtrError, match='depth'):
        ResNetClassifier(depth=42)
    with pytest.raises(MmdtrError, match='num_classes'):
        ResNetClassifier(depth=18, num_classes=0)
    for dropout in (1.5, -0.1, '0.1', True):
        with pytest.raises(MmdtrError, match='ResNetClassifier dropout'):
            ResNetClassifier(depth=18, dropout=dropout)
    model = ResNetClassifier(depth=18, num_classes=4)
    images, labels = _batch(4)
    with pytest.raises(MmdtrError, match='data_samples'):
        model(images, mode='loss')
    with pytest.raises(MmdtrError, match='mode'):
        model(images, labels, mode='train')
    with pytest.raises(MmdtrError, match=r'\(N, C, H, W\)'):
        model(images[0], labels, mode='loss')
    with pytest.raises(MmdtrError, match='int64'):
        model(images, labels.float(), mode='loss')


@pytest.mark.parametrize('kwargs, match', [
    (dict(depth=[18, 34]), 'depth must be one of'),
    (dict(depth=True), 'depth must be one of'),
    (dict(in_channels='abc'), 'ResNet in_channels must be a positive int'),
    (dict(base_channels=0), 'ResNet base_channels must be a positive int'),
    (dict(zero_init_residual='False'), 'zero_init_residual must be True or'),
    (dict(num_classes=True), 'num_classes must be a positive int'),
    (dict(data_preprocessor=[]), 'data_preprocessor=.* is not accepted'),
    (dict(
        data_preprocessor=dict(
            type='TensorBatchPreprocessor', non_blocking='yes')),
     'non_blocking must be'),
])
def test_arguments_of_the_wrong_type_are_refused_by_name(kwargs, match):
    with pytest.raises(MmdtrError, match=match):
        ResNetClassifier(**{'depth': 18, **kwargs})


def test_numpy_numbers_and_0_or_1_switches_are_read_as_numbers():
    """A config may compute sizes with NumPy; they built before the checks
    (found by a review)."""
    model = ResNetClassifier(
        depth=np.int64(18),
        num_classes=np.int64(4),
        base_channels=np.int64(8),
        dropout=np.float32(0.25),
        zero_init_residual=1)
    assert model.num_classes == 4 and type(model.num_classes) is int
    assert model.head.dropout.p == 0.25
