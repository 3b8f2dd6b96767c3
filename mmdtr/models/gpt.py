"""A GPT-style decoder-only language model with explicit attention."""
import math
from typing import Dict, List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModel

from mmdtr.errors import MmdtrError
from mmdtr.registry import MODELS
from .arguments import check_positive_ints, check_probabilities
from .base_classifier import MODES, describe_value
from .data_preprocessor import build_data_preprocessor


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written with matmul and softmax.

    No fused or flash kernel: the attention matrix is materialised, so the
    model behaves (and uses memory) the same on every device.

    Args:
        embed_dims (int): Model width; divisible by ``num_heads``.
        num_heads (int): Number of heads.
        max_seq_len (int): Longest sequence (size of the causal mask).
        attn_dropout (float): Dropout on the attention probabilities.
        resid_dropout (float): Dropout on the output projection.
    """

    def __init__(self, embed_dims: int, num_heads: int, max_seq_len: int,
                 attn_dropout: float, resid_dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.qkv = nn.Linear(embed_dims, 3 * embed_dims)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.attn_drop = nn.Dropout(attn_dropout)
        self.resid_drop = nn.Dropout(resid_dropout)
        mask = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).tril()
        self.register_buffer('causal_mask', mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the past; (N, T, C) -> (N, T, C)."""
        n, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(n, t, self.num_heads, self.head_dims).transpose(1, 2)
        k = k.view(n, t, self.num_heads, self.head_dims).transpose(1, 2)
        v = v.view(n, t, self.num_heads, self.head_dims).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dims))
        scores = scores.masked_fill(~self.causal_mask[:t, :t], float('-inf'))
        attn = self.attn_drop(F.softmax(scores, dim=-1))
        out = (attn @ v).transpose(1, 2).contiguous().view(n, t, c)
        return self.resid_drop(self.proj(out))


class MLP(nn.Module):
    """Linear, GELU, linear, dropout.

    Args:
        embed_dims (int): Model width.
        hidden_dims (int): Hidden width.
        dropout (float): Dropout on the output.
    """

    def __init__(self, embed_dims: int, hidden_dims: int, dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, hidden_dims)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dims, embed_dims)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, C) -> (N, T, C)."""
        return self.drop(self.fc2(self.act(self.fc1(x))))


class GPTBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, ``x + mlp(...)``.

    Args:
        embed_dims (int): Model width.
        num_heads (int): Attention heads.
        max_seq_len (int): Longest sequence.
        mlp_ratio (int): MLP hidden width over ``embed_dims``.
        attn_dropout (float): Dropout on attention probabilities.
        resid_dropout (float): Dropout on both residual branches.
    """

    def __init__(self, embed_dims: int, num_heads: int, max_seq_len: int,
                 mlp_ratio: int, attn_dropout: float, resid_dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dims)
        self.attn = CausalSelfAttention(embed_dims, num_heads, max_seq_len,
                                        attn_dropout, resid_dropout)
        self.ln2 = nn.LayerNorm(embed_dims)
        self.mlp = MLP(embed_dims, mlp_ratio * embed_dims, resid_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, C) -> (N, T, C)."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@MODELS.register_module()
class GPTDecoder(BaseModel):
    """A GPT-2-style decoder-only language model.

    Token and learned position embeddings, ``num_layers`` pre-norm blocks
    of causal self-attention and a GELU MLP, a final LayerNorm and an output
    projection tied to the token embedding. The loss is the next-token
    cross-entropy. Weights are initialised as GPT-2 (normal, std 0.02,
    residual projections scaled by ``1/sqrt(2 * num_layers)``).

    Args:
        vocab_size (int): Vocabulary size. Defaults to 8192.
        max_seq_len (int): Longest input sequence. Defaults to 128.
        num_layers (int): Number of blocks. Defaults to 4.
        num_heads (int): Attention heads. Defaults to 4.
        embed_dims (int): Model width. Defaults to 256.
        mlp_ratio (int): MLP hidden width over ``embed_dims``.
            Defaults to 4.
        embed_dropout (float): Dropout on the embeddings. Defaults to 0.1.
        attn_dropout (float): Dropout on attention probabilities.
            Defaults to 0.1.
        resid_dropout (float): Dropout on the residual branches.
            Defaults to 0.1.
        data_preprocessor (dict | nn.Module, optional): Defaults to
            :class:`TensorBatchPreprocessor`.
        init_cfg (dict, optional): MMEngine initialisation config.

    Examples:
        >>> model = dict(
        ...     type='GPTDecoder', vocab_size=8192, max_seq_len=128,
        ...     num_layers=4, num_heads=4, embed_dims=256)
        >>> # GPT-2 small: vocab_size=50257, max_seq_len=1024,
        >>> # num_layers=12, num_heads=12, embed_dims=768
    """

    def __init__(self,
                 vocab_size: int = 8192,
                 max_seq_len: int = 128,
                 num_layers: int = 4,
                 num_heads: int = 4,
                 embed_dims: int = 256,
                 mlp_ratio: int = 4,
                 embed_dropout: float = 0.1,
                 attn_dropout: float = 0.1,
                 resid_dropout: float = 0.1,
                 data_preprocessor: Optional[Union[dict, nn.Module]] = None,
                 init_cfg: Optional[dict] = None):
        super().__init__(
            data_preprocessor=build_data_preprocessor(data_preprocessor),
            init_cfg=init_cfg)
        (vocab_size, max_seq_len, num_layers, num_heads, embed_dims,
         mlp_ratio) = check_positive_ints(
             'GPTDecoder',
             vocab_size=vocab_size,
             max_seq_len=max_seq_len,
             num_layers=num_layers,
             num_heads=num_heads,
             embed_dims=embed_dims,
             mlp_ratio=mlp_ratio)
        embed_dropout, attn_dropout, resid_dropout = check_probabilities(
            'GPTDecoder',
            embed_dropout=embed_dropout,
            attn_dropout=attn_dropout,
            resid_dropout=resid_dropout)
        if embed_dims % num_heads:
            raise MmdtrError(
                f'GPTDecoder embed_dims ({embed_dims}) must be divisible by '
                f'num_heads ({num_heads}).',
                hint='change model.embed_dims or model.num_heads, e.g. '
                'embed_dims=256 with num_heads=4.')
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(vocab_size, embed_dims)
        self.position_embedding = nn.Embedding(max_seq_len, embed_dims)
        self.embed_drop = nn.Dropout(embed_dropout)
        self.blocks = nn.ModuleList(
            GPTBlock(embed_dims, num_heads, max_seq_len, mlp_ratio,
                     attn_dropout, resid_dropout) for _ in range(num_layers))
        self.ln_final = nn.LayerNorm(embed_dims)
        self.lm_head = nn.Linear(embed_dims, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied
        self._init_gpt2_weights(num_layers)

    def _init_gpt2_weights(self, num_layers: int) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(
                    proj.weight, std=0.02 / math.sqrt(2 * num_layers))

    def forward(
        self,
        inputs: torch.Tensor,
        data_samples: Optional[torch.Tensor] = None,
        mode: str = 'tensor'
    ) -> Union[torch.Tensor, Dict[str, torch.Tensor], List[dict]]:
        """Run the language model in one of MMEngine's three modes.

        Args:
            inputs (Tensor): Token ids of shape (N, T), ``T <= max_seq_len``.
            data_samples (Tensor, optional): Target ids of shape (N, T), the
                token that follows each input token (``-100`` is ignored).
                When None, ``mode='loss'`` predicts ``inputs[:, 1:]`` from
                ``inputs[:, :-1]``.
            mode (str): ``'tensor'`` returns the logits (N, T, vocab_size);
                ``'loss'`` returns ``dict(loss=...)``, the mean next-token
                cross-entropy; ``'predict'`` returns one dict per sequence
                with ``pred_tokens`` (greedy next tokens, shape (T,)) and,
                when targets are given, ``gt_tokens``.

        Returns:
            Tensor | dict | list[dict]: See ``mode``.
        """
        if mode not in MODES:
            raise MmdtrError(
                f'forward mode must be one of {MODES}, got {mode!r}.',
                hint="call the model with mode='tensor', 'loss' or "
                "'predict'.")
        self._check_tokens(inputs, 'inputs')
        if data_samples is not None:
            self._check_tokens(data_samples, 'data_samples')
            if data_samples.shape != inputs.shape:
                raise MmdtrError(
                    f'GPTDecoder targets have shape '
                    f'{tuple(data_samples.shape)}, inputs '
                    f'{tuple(inputs.shape)}; they must match.',
                    hint='give one target id per input token (-100 to '
                    'ignore one), or no data_samples to predict '
                    'inputs[:, 1:].')
        logits = self._logits(inputs)
        if mode == 'tensor':
            return logits
        if mode == 'loss':
            targets = data_samples
            if targets is None:
                logits, targets = logits[:, :-1], inputs[:, 1:]
            loss = F.cross_entropy(
                logits.reshape(-1, self.vocab_size), targets.reshape(-1))
            return dict(loss=loss)
        pred_tokens = logits.detach().argmax(dim=-1)
        predictions = []
        for i in range(pred_tokens.size(0)):
            pred = dict(pred_tokens=pred_tokens[i])
            if data_samples is not None:
                pred['gt_tokens'] = data_samples[i]
            predictions.append(pred)
        return predictions

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        x = self.embed_drop(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_final(x))

    def _check_tokens(self, tokens, name: str) -> None:
        if (not isinstance(tokens, torch.Tensor) or tokens.dim() != 2
                or tokens.dtype != torch.int64):
            raise MmdtrError(
                f'GPTDecoder {name} must be an int64 tensor of shape (N, T), '
                f'got {describe_value(tokens)}.',
                hint=f'pass {name} as int64 token ids batched to (N, T), '
                'e.g. as SyntheticTokenDataset returns them.')
        if tokens.size(1) > self.max_seq_len:
            raise MmdtrError(
                f'GPTDecoder {name} has {tokens.size(1)} tokens, more than '
                f'max_seq_len={self.max_seq_len}.',
                hint='raise model.max_seq_len or lower the dataset seq_len.')
