# ShuffleNetV2 x1.0 for 1000 classes.
# Wider: --cfg-options model.widen_factor=2.0 (0.5, 1.0, 1.5 or 2.0)
model = dict(
    type='ShuffleNetV2Classifier',
    widen_factor=1.0,
    num_classes=1000,
    data_preprocessor=dict(type='TensorBatchPreprocessor'))
