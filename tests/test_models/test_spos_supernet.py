import random

import numpy as np
import pytest
import torch

from mmdtr.errors import MmdtrError
from mmdtr.models import SPOS_CHOICES, SPOSSupernet
from mmdtr.registry import MODELS

# a small but complete search space: 5 layers x 4 choices
SMALL = dict(
    num_classes=5,
    stage_blocks=(1, 2, 1, 1),
    stage_channels=(16, 32, 32, 64),
    last_channels=64)


def _batch(n=2, size=32):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 3, size, size,
                        generator=g), torch.randint(5, (n, ), generator=g))


def _train_paths(model, num_iters):
    images, labels = _batch()
    paths = []
    for _ in range(num_iters):
        model(images, labels, mode='loss')['loss'].backward()
        paths.append(model.last_path)
    return paths


def test_default_supernet_has_20_layers_of_4_choices():
    model = MODELS.build(dict(type='SPOSSupernet'))
    assert len(model.choice_layers) == 20
    for layer in model.choice_layers:
        assert set(layer.choices) == set(SPOS_CHOICES)
    images, labels = _batch(n=2, size=64)
    assert model(images, mode='tensor').shape == (2, 1000)


def test_a_new_path_every_training_iteration():
    model = SPOSSupernet(seed=0, **SMALL).train()
    paths = _train_paths(model, 6)
    assert model.num_sampled_paths == 6
    assert len(set(paths)) > 1
    for path in paths:
        assert len(path) == 5 and set(path) <= set(SPOS_CHOICES)
    # the active blocks are the last path's
    assert [layer.active_choice for layer in model.choice_layers] == \
        list(paths[-1])


def test_same_seed_same_paths_whatever_the_global_rng():
    torch.manual_seed(0)
    random.seed(0)
    first = _train_paths(SPOSSupernet(seed=7, **SMALL).train(), 5)
    torch.manual_seed(123)
    random.seed(123)
    second = _train_paths(SPOSSupernet(seed=7, **SMALL).train(), 5)
    assert first == second
    other = _train_paths(SPOSSupernet(seed=8, **SMALL).train(), 5)
    assert other != first


def test_sampling_leaves_global_rngs_untouched():
    model = SPOSSupernet(seed=0, **SMALL).train()
    images, labels = _batch()
    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    for _ in range(3):
        model(images, labels, mode='loss')
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state
    assert model.num_sampled_paths == 3


def test_tensor_predict_and_eval_loss_reuse_the_last_path():
    model = SPOSSupernet(seed=0, **SMALL).train()
    images, labels = _batch()
    # before any training: the first choice everywhere, nothing sampled
    model(images, mode='tensor')
    assert model.last_path == ('shuffle_3x3', ) * 5
    assert model.num_sampled_paths == 0
    last = _train_paths(model, 2)[-1]
    model(images, mode='tensor')
    model(images, labels, mode='predict')
    model.eval()
    model(images, labels, mode='loss')
    assert model.last_path == last
    assert model.num_sampled_paths == 2


def test_fixed_path_and_reset_sampler():
    model = SPOSSupernet(seed=3, **SMALL).train()
    first = _train_paths(model, 3)
    path = ('shuffle_xception', 'shuffle_7x7', 'shuffle_5x5', 'shuffle_3x3',
            'shuffle_7x7')
    model.set_path(path)
    assert _train_paths(model, 2) == [path, path]
    model.set_path(None)
    model.reset_sampler()
    assert _train_paths(model, 3) == first
    with pytest.raises(MmdtrError, match='needs 5 names'):
        model.set_path(('shuffle_3x3', ) * 4)
    with pytest.raises(MmdtrError, match='needs 5 names'):
        model.set_path(('shuffle_9x9', ) * 5)


def test_gradients_reach_the_active_choices_only(biases_cancelled_by_next_bn):
    model = SPOSSupernet(seed=0, **SMALL).train()
    path = _train_paths(model, 1)[0]
    zero_by_design = biases_cancelled_by_next_bn(model)
    assert zero_by_design  # the depthwise BNs of every choice block
    for name, param in model.named_parameters():
        if '.choices.' in name:
            layer_index = int(name.split('.layers.')[1].split('.')[0])
            choice = name.split('.choices.')[1].split('.')[0]
            used = path[layer_index] == choice
        else:
            used = True
        if used:
            assert param.grad is not None, name
            if name not in zero_by_design:
                assert param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_choice_subset_and_predictions():
    model = SPOSSupernet(
        choices=['shuffle_5x5', 'shuffle_xception'], **SMALL).train()
    paths = _train_paths(model, 4)
    assert set().union(*paths) <= {'shuffle_5x5', 'shuffle_xception'}
    images, labels = _batch()
    preds = model(images, labels, mode='predict')
    assert len(preds) == 2 and preds[0]['pred_score'].shape == (5, )


def test_bad_arguments_raise():
    with pytest.raises(MmdtrError, match='choices'):
        SPOSSupernet(choices=['shuffle_3x3', 'conv_9x9'])
    with pytest.raises(MmdtrError, match='choices'):
        SPOSSupernet(choices=[])
    with pytest.raises(MmdtrError, match='seed'):
        SPOSSupernet(seed=-1)
    with pytest.raises(MmdtrError, match='SPOSSupernet dropout'):
        SPOSSupernet(dropout=1.01)
    with pytest.raises(MmdtrError, match='same length'):
        SPOSSupernet(stage_blocks=(1, 1), stage_channels=(8, 16, 32))


@pytest.mark.parametrize('kwargs, match', [
    (dict(stage_blocks=4), 'lists of positive ints'),
    (dict(stage_blocks=[4, 4, 8, 1.5]), 'lists of positive ints'),
    (dict(stage_channels=[64, 160, 320, 0]), 'lists of positive ints'),
    (dict(choices='shuffle_3x3'), "choices must be a list .* got 'shuffle"),
    (dict(choices=['shuffle_3x3', ['x']]), 'choices must be a list'),
    (dict(choices=None), 'choices must be a list'),
    (dict(widen_factor=0), 'widen_factor must be a positive number'),
    (dict(widen_factor=float('nan')), 'widen_factor must be a positive'),
    (dict(stem_channels=0), 'stem_channels must be a positive int'),
    (dict(in_channels=True), 'in_channels must be a positive int'),
    (dict(seed=True), 'seed must be a non-negative int'),
])
def test_arguments_of_the_wrong_type_are_refused_by_name(kwargs, match):
    with pytest.raises(MmdtrError, match=match):
        SPOSSupernet(**kwargs)


def test_stage_lists_and_choices_may_be_any_sequence_of_numbers():
    """NumPy arrays, whole floats and the choices' own dict built before the
    checks (found by a review)."""
    model = SPOSSupernet(
        stage_blocks=np.array([1, 1, 1, 1]),
        stage_channels=[16.0, 32, 64, 128],
        widen_factor=np.float32(1.0),
        choices=SPOS_CHOICES,
        seed=np.int64(1))
    assert model.choices == tuple(SPOS_CHOICES)
    assert len(model.backbone.layers) == 4
