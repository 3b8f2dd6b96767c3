import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mmengine.dataset import default_collate
from torch.utils.data import DataLoader

from mmdtr.datasets import (SyntheticImageDataset, SyntheticTokenDataset,
                            sample_generator)
from mmdtr.errors import MmdtrError
from mmdtr.registry import DATASETS


def _image_ds(seed=0, **kwargs):
    kwargs.setdefault('num_samples', 20)
    kwargs.setdefault('image_size', 8)
    kwargs.setdefault('num_classes', 10)
    return SyntheticImageDataset(seed=seed, **kwargs)


def _token_ds(seed=0, **kwargs):
    kwargs.setdefault('num_samples', 20)
    kwargs.setdefault('seq_len', 12)
    kwargs.setdefault('vocab_size', 50)
    return SyntheticTokenDataset(seed=seed, **kwargs)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize('make', [_image_ds, _token_ds])
def test_samples_depend_on_seed_and_index_only(make):
    first = make(seed=3)
    forward = [first[i] for i in range(len(first))]
    second = make(seed=3)
    backward = [second[i] for i in reversed(range(len(second)))][::-1]
    assert all(_same(a, b) for a, b in zip(forward, backward))
    # samples differ across indices and across seeds
    assert not _same(forward[0], forward[1])
    assert not _same(forward[0], make(seed=4)[0])
    # the length does not change a sample
    assert _same(make(seed=3, num_samples=500)[7], forward[7])


@pytest.mark.parametrize('make', [_image_ds, _token_ds])
def test_global_rngs_are_left_untouched(make):
    torch_state = torch.get_rng_state()
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    dataset = make()
    samples = [dataset[i] for i in range(5)]
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert all(
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
        for a, b in zip(np.random.get_state(), numpy_state))
    assert random.getstate() == python_state
    # and the global seed does not change the samples
    torch.manual_seed(1234)
    assert _same(make()[4], samples[4])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**63), index=st.integers(0, 2**40), other=st.data())
def test_sample_generator_is_a_function_of_seed_and_index(seed, index, other):
    draw = torch.randint(2**62, (2, ), generator=sample_generator(seed, index))
    again = torch.randint(
        2**62, (2, ), generator=sample_generator(seed, index))
    assert torch.equal(draw, again)
    other_index = other.draw(
        st.integers(0, 2**40).filter(lambda i: i != index))
    elsewhere = torch.randint(
        2**62, (2, ), generator=sample_generator(seed, other_index))
    assert not torch.equal(draw, elsewhere)


def test_image_samples_format():
    dataset = DATASETS.build(
        dict(
            type='SyntheticImageDataset',
            num_samples=50,
            image_size=(6, 9),
            num_classes=4,
            seed=0))
    assert len(dataset) == 50
    labels = set()
    for i in range(50):
        sample = dataset[i]
        assert sample['inputs'].shape == (3, 6, 9)
        assert sample['inputs'].dtype == torch.float32
        assert sample['data_samples'].dtype == torch.int64
        assert sample['data_samples'].dim() == 0
        labels.add(int(sample['data_samples']))
    assert labels == {0, 1, 2, 3}
    pixels = torch.stack([dataset[i]['inputs'] for i in range(50)])
    assert abs(pixels.mean()) < 0.1 and abs(pixels.std() - 1) < 0.1
    assert dataset.metainfo == dict(num_classes=4)


def test_token_samples_are_shifted_sequences():
    dataset = DATASETS.build(
        dict(
            type='SyntheticTokenDataset',
            num_samples=30,
            seq_len=7,
            vocab_size=5,
            seed=1))
    tokens = set()
    for i in range(30):
        sample = dataset[i]
        inputs, targets = sample['inputs'], sample['data_samples']
        assert inputs.shape == targets.shape == (7, )
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[1:], targets[:-1])
        tokens |= set(inputs.tolist()) | set(targets.tolist())
    assert tokens == set(range(5))


@pytest.mark.parametrize('make,inputs_shape,targets_shape',
                         [(_image_ds, (4, 3, 8, 8), (4, )),
                          (_token_ds, (4, 12), (4, 12))])
def test_default_collate_builds_model_ready_batches(make, inputs_shape,
                                                    targets_shape):
    loader = DataLoader(make(), batch_size=4, collate_fn=default_collate)
    batch = next(iter(loader))
    assert batch['inputs'].shape == inputs_shape
    assert batch['data_samples'].shape == targets_shape
    assert len(list(loader)) == 5


def test_indexing_bounds():
    dataset = _token_ds(num_samples=3)
    assert _same(dataset[-1], dataset[2])
    with pytest.raises(IndexError):
        dataset[3]
    with pytest.raises(IndexError):
        dataset[-4]
    # plain iteration stops at the IndexError
    assert len(list(dataset)) == 3


@pytest.mark.parametrize(
    'kwargs,match',
    [
        (dict(num_samples=0), 'num_samples'),
        (dict(seed=-1), 'seed'),
        (dict(image_size=(8, 8, 8)), 'image_size'),
        (dict(image_size=0), 'image_size'),
        # a string whole, not its characters; None and a float by name too
        (dict(image_size='112'), "got '112'"),
        (dict(image_size=None), 'image_size .* got None'),
        (dict(image_size=112.0), 'got 112.0'),
        (dict(num_classes=0), 'num_classes'),
    ])
def test_bad_image_arguments_raise(kwargs, match):
    with pytest.raises(MmdtrError, match=match):
        _image_ds(**kwargs)


@pytest.mark.parametrize('kwargs,match', [
    (dict(seq_len=0), 'seq_len'),
    (dict(vocab_size=1.5), 'vocab_size'),
])
def test_bad_token_arguments_raise(kwargs, match):
    with pytest.raises(MmdtrError, match=match):
        _token_ds(**kwargs)
