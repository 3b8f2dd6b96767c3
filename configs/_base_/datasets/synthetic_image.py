# Random 112x112 images with random labels of 1000 classes, batch 8.
# Bigger: --cfg-options train_dataloader.batch_size=32 \
#     train_dataloader.dataset.image_size=224
# (keep train_dataloader.dataset.num_classes equal to model.num_classes)
train_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    collate_fn=dict(type='default_collate'),
    dataset=dict(
        type='SyntheticImageDataset',
        num_samples=1000,
        image_size=112,
        num_classes=1000,
        seed=0))
