# AdamW (GPT-style betas, gradient clipping, no weight decay on biases and
# norms) at a constant learning rate for a short iteration-based run.
# bypass_duplicate skips the tied embedding/output weight the second time.
# Longer: --cfg-options train_cfg.max_iters=1000
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1),
    paramwise_cfg=dict(
        norm_decay_mult=0.0, bias_decay_mult=0.0, bypass_duplicate=True),
    clip_grad=dict(max_norm=1.0))
train_cfg = dict(type='IterBasedTrainLoop', max_iters=10)
