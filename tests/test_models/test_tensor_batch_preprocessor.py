import torch
from mmengine.dataset import default_collate, pseudo_collate

from mmdtr.models import ResNetClassifier, TensorBatchPreprocessor
from mmdtr.registry import MODELS


def _samples(n=3):
    return [
        dict(
            inputs=torch.full((2, 4, 4), float(i)),
            data_samples=torch.tensor(i)) for i in range(n)
    ]


def test_pseudo_and_default_collate_give_the_same_batch():
    preprocessor = MODELS.build(dict(type='TensorBatchPreprocessor'))
    from_pseudo = preprocessor(pseudo_collate(_samples()), training=True)
    from_default = preprocessor(default_collate(_samples()), training=True)
    for batch in (from_pseudo, from_default):
        assert batch['inputs'].shape == (3, 2, 4, 4)
        assert batch['data_samples'].tolist() == [0, 1, 2]
    assert torch.equal(from_pseudo['inputs'], from_default['inputs'])


def test_missing_data_samples_and_non_tensor_values_pass_through():
    preprocessor = TensorBatchPreprocessor()
    batch = preprocessor(dict(inputs=[torch.zeros(2), torch.ones(2)]))
    assert batch['data_samples'] is None
    assert batch['inputs'].tolist() == [[0., 0.], [1., 1.]]
    meta = preprocessor(dict(inputs=torch.zeros(1), data_samples=['a']))
    assert meta['data_samples'] == ['a']


def test_models_default_to_it_and_train_step_works():
    model = ResNetClassifier(depth=18, num_classes=3)
    assert isinstance(model.data_preprocessor, TensorBatchPreprocessor)
    samples = [
        dict(inputs=torch.randn(3, 32, 32), data_samples=torch.tensor(i))
        for i in range(3)
    ]
    data = model.data_preprocessor(pseudo_collate(samples), True)
    losses = model(**data, mode='loss')
    assert torch.isfinite(losses['loss'])
