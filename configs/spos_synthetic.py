# Trains the SPOS ShuffleNetV2 supernet on random 112x112 images (1000
# classes), batch 8, SGD, 10 iterations, one sampled path per iteration: a
# few seconds on a CPU. The path sequence depends on model.seed only.
# Scale up, e.g.: --cfg-options train_dataloader.batch_size=128 \
#     train_dataloader.dataset.image_size=224 model.widen_factor=2.0
# Under DDP, also set model_wrapper_cfg=dict(
#     type='MMDistributedDataParallel', find_unused_parameters=True); from
#     the command line: --cfg-options \
#     model_wrapper_cfg.type=MMDistributedDataParallel \
#     model_wrapper_cfg.find_unused_parameters=True
_base_ = [
    '_base_/models/spos_shufflenet.py',
    '_base_/datasets/synthetic_image.py',
    '_base_/schedules/sgd_short.py',
    '_base_/default_runtime.py',
]
