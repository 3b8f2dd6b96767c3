# Runtime shared by every mmdtr workload: CPU-friendly, short-run logging,
# no checkpoints by default (enable with
# --cfg-options default_hooks.checkpoint.interval=1000).
default_scope = 'mmdtr'
custom_imports = dict(imports=['mmdtr'], allow_failed_imports=False)

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=2),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(
        type='CheckpointHook', by_epoch=False, interval=-1, save_last=False),
    sampler_seed=dict(type='DistSamplerSeedHook'),
)

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'),
)

vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='Visualizer', vis_backends=vis_backends)

log_processor = dict(by_epoch=False, window_size=10)
log_level = 'INFO'
load_from = None
resume = False
randomness = dict(seed=0, deterministic=False)
