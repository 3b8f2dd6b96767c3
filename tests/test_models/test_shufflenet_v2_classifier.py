import pytest
import torch
import torch.nn as nn

from mmdtr.errors import MmdtrError
from mmdtr.models import ShuffleNetV2Classifier, ShuffleUnit
from mmdtr.models.shufflenet_v2 import channel_shuffle
from mmdtr.registry import MODELS


@pytest.mark.parametrize('widen_factor,num_params', [(0.5, 1_366_792),
                                                     (1.0, 2_278_604)])
def test_parameter_count_matches_reference(widen_factor, num_params):
    # the torchvision counts of shufflenet_v2_x0_5 / x1_0, 1000 classes
    model = MODELS.build(
        dict(type='ShuffleNetV2Classifier', widen_factor=widen_factor))
    assert sum(p.numel() for p in model.parameters()) == num_params


def test_channel_shuffle_interleaves_groups():
    x = torch.arange(6.).view(1, 6, 1, 1)
    out = channel_shuffle(x, 2).flatten().tolist()
    assert out == [0., 3., 1., 4., 2., 5.]
    out3 = channel_shuffle(x, 3).flatten().tolist()
    assert out3 == [0., 2., 4., 1., 3., 5.]


def test_stride_one_unit_passes_half_of_the_channels_through():
    unit = ShuffleUnit(8, 8, stride=1).eval()
    x = torch.randn(2, 8, 5, 5)
    out = unit(x)
    assert out.shape == x.shape
    # after the shuffle, even channels are the untouched first half
    torch.testing.assert_close(out[:, 0::2], x[:, :4])


@pytest.mark.parametrize(
    'kwargs', [dict(kernel_size=3),
               dict(kernel_size=7),
               dict(xception=True)])
def test_stride_two_unit_halves_resolution(kwargs):
    unit = ShuffleUnit(8, 16, stride=2, **kwargs)
    assert unit(torch.randn(2, 8, 9, 9)).shape == (2, 16, 5, 5)


def test_three_modes_and_gradients(biases_cancelled_by_next_bn):
    model = ShuffleNetV2Classifier(widen_factor=0.5, num_classes=6).train()
    images = torch.randn(4, 3, 64, 64)
    labels = torch.tensor([0, 5, 2, 2])
    loss = model(images, labels, mode='loss')
    assert set(loss) == {'loss'} and torch.isfinite(loss['loss'])
    loss['loss'].backward()
    zero_by_design = biases_cancelled_by_next_bn(model)
    # the depthwise BN of 16 main branches and 3 stride-2 projections
    assert len(zero_by_design) == 19
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        if name in zero_by_design:
            assert param.grad.abs().max() < 1e-4, name
        else:
            assert param.grad.abs().sum() > 0, name
    model.eval()
    logits = model(images, mode='tensor')
    assert logits.shape == (4, 6)
    preds = model(images, labels, mode='predict')
    assert [int(p['pred_label']) for p in preds] == \
        logits.argmax(1).tolist()


def test_uses_bn_and_inplace_relu():
    model = ShuffleNetV2Classifier()
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    assert relus and all(m.inplace for m in relus)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_bad_arguments_raise():
    with pytest.raises(MmdtrError, match='widen_factor'):
        ShuffleNetV2Classifier(widen_factor=0.7)
    with pytest.raises(MmdtrError, match='ShuffleNetV2Classifier dropout'):
        ShuffleNetV2Classifier(dropout=-0.5)
    with pytest.raises(MmdtrError, match='widen_factor must be one of'):
        ShuffleNetV2Classifier(widen_factor=[1, 2])  # unhashable before
    with pytest.raises(MmdtrError, match='in_channels must be a positive'):
        ShuffleNetV2Classifier(in_channels=-1)
    with pytest.raises(MmdtrError, match='keeps the channels'):
        ShuffleUnit(8, 16, stride=1)
    with pytest.raises(MmdtrError, match='even'):
        ShuffleUnit(8, 15, stride=2)
