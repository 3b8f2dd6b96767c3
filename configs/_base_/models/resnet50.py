# ResNet-50 (BN, in-place ReLU, bottlenecks) for 1000 classes.
# Other depths: --cfg-options model.depth=101
model = dict(
    type='ResNetClassifier',
    depth=50,
    num_classes=1000,
    data_preprocessor=dict(type='TensorBatchPreprocessor'))
