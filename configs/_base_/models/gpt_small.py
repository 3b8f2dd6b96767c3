# A small GPT decoder: 4 layers, 256 wide, 4 heads, 128 tokens, vocab 8192.
# GPT-2 small: --cfg-options model.num_layers=12 model.embed_dims=768 \
#     model.num_heads=12 model.max_seq_len=1024 model.vocab_size=50257
model = dict(
    type='GPTDecoder',
    vocab_size=8192,
    max_seq_len=128,
    num_layers=4,
    num_heads=4,
    embed_dims=256,
    mlp_ratio=4,
    embed_dropout=0.1,
    attn_dropout=0.1,
    resid_dropout=0.1,
    data_preprocessor=dict(type='TensorBatchPreprocessor'))
