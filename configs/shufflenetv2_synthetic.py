# Trains ShuffleNetV2 x1.0 on random 112x112 images (1000 classes), batch 8,
# SGD, 10 iterations: a few seconds on a CPU.
# Scale up, e.g.: --cfg-options train_dataloader.batch_size=128 \
#     train_dataloader.dataset.image_size=224 model.widen_factor=2.0
_base_ = [
    '_base_/models/shufflenetv2.py',
    '_base_/datasets/synthetic_image.py',
    '_base_/schedules/sgd_short.py',
    '_base_/default_runtime.py',
]
