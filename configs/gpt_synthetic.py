# Trains a small GPT decoder (4 layers, 256 wide, 4 heads) on random
# 128-token sequences (vocab 8192), batch 8, AdamW, 10 iterations: a few
# seconds on a CPU.
# Scale up, e.g.: --cfg-options train_dataloader.batch_size=32 \
#     model.num_layers=12 model.embed_dims=768 model.num_heads=12 \
#     model.max_seq_len=1024 train_dataloader.dataset.seq_len=1024
# (keep train_dataloader.dataset.vocab_size equal to model.vocab_size).
_base_ = [
    '_base_/models/gpt_small.py',
    '_base_/datasets/synthetic_tokens.py',
    '_base_/schedules/adamw_short.py',
    '_base_/default_runtime.py',
]
