# Random token sequences of 128 tokens from a vocabulary of 8192, batch 8.
# Bigger: --cfg-options train_dataloader.batch_size=32 \
#     train_dataloader.dataset.seq_len=1024
# (keep seq_len <= model.max_seq_len and vocab_size == model.vocab_size)
train_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    collate_fn=dict(type='default_collate'),
    dataset=dict(
        type='SyntheticTokenDataset',
        num_samples=1000,
        seq_len=128,
        vocab_size=8192,
        seed=0))
