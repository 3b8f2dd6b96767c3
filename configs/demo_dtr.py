# The Quick start's demo: ResNet-50 on random 112x112 images, batch 16, SGD,
# 4 iterations, with DTR evicting above 230MB (about 60% of what the step
# needs without it on CPU). `python tools/demo.py` trains it without and with
# DTR and prints peak memory and time per iteration of both.
# Lower the threshold: --cfg-options dtr.eviction_threshold=200MB
_base_ = ['./resnet50_synthetic.py']

train_dataloader = dict(batch_size=16)
train_cfg = dict(type='IterBasedTrainLoop', max_iters=4)
default_hooks = dict(logger=dict(type='LoggerHook', interval=1))
dtr = dict(eviction_threshold='230MB')
