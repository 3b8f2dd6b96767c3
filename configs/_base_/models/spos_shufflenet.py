# SPOS supernet: 20 searchable layers of 4 ShuffleNetV2 choice blocks
# (3x3, 5x5, 7x7, xception); a new path every training iteration, drawn
# from a private RNG seeded by model.seed.
# Wider: --cfg-options model.widen_factor=2.0
model = dict(
    type='SPOSSupernet',
    num_classes=1000,
    widen_factor=1.0,
    choices=['shuffle_3x3', 'shuffle_5x5', 'shuffle_7x7', 'shuffle_xception'],
    seed=0,
    data_preprocessor=dict(type='TensorBatchPreprocessor'))
