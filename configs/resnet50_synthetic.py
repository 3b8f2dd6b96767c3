# Trains ResNet-50 on random 112x112 images (1000 classes), batch 8, SGD,
# 10 iterations: a few seconds on a CPU.
# Scale up, e.g.: --cfg-options train_dataloader.batch_size=64 \
#     train_dataloader.dataset.image_size=224 train_cfg.max_iters=100
# Other depths: model.depth=18|34|101|152.
_base_ = [
    '_base_/models/resnet50.py',
    '_base_/datasets/synthetic_image.py',
    '_base_/schedules/sgd_short.py',
    '_base_/default_runtime.py',
]
