# SGD with momentum at a constant learning rate for a short iteration-based
# run. lr follows the linear scaling rule 0.1 * batch_size / 256 for batch 8;
# scale it with the batch (e.g. optim_wrapper.optimizer.lr=0.025 for 64).
# Labels are random, so the loss cannot fall below ln(num_classes): these
# are memory and speed workloads.
# Longer: --cfg-options train_cfg.max_iters=1000
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='SGD', lr=0.003, momentum=0.9, weight_decay=1e-4))
train_cfg = dict(type='IterBasedTrainLoop', max_iters=10)
