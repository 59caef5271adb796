"""A small decoder-only transformer as three kinds of top-level layers, so that a pipeline can cut between blocks.

The model is ``nn.Sequential(Embed, Block, ..., Block, Head)``: every layer takes and returns one tensor
(token ids ``[N, T]`` into ``Embed``, activations ``[N, T, d]`` between layers, scores ``[N, T, V]`` out of
``Head``), which is all a pipeline stage boundary can carry. Blocks are pre-norm (LayerNorm before attention
and before the MLP, residuals around both), the arrangement of GPT-2 that trains stably without warm-up at
this size; attention is causal through ``scaled_dot_product_attention(is_causal=True)``, so position t sees
positions 0..t only. No dropout and no batch statistics: a micro-batch's output depends on its own examples
only, so a pipeline's micro-batching changes nothing (BatchNorm would break that).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional

__all__ = ["Block", "Embed", "Head", "transformer"]

_INIT_STD = 0.02  # GPT-2's: embeddings and projections start small, so the residual stream starts near zero


class Embed(nn.Module):
    """Token ids ``[N, T]`` (T at most ``context``) to token plus learned position embeddings ``[N, T, d]``."""

    def __init__(self, *, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.context = context
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.empty(context, width))
        nn.init.normal_(self.token.weight, std=_INIT_STD)
        nn.init.normal_(self.position, std=_INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeds ``tokens``; raises ValueError for windows longer than the context it was built for."""
        length = tokens.shape[-1]
        if length > self.context:
            raise ValueError(f"a window of {length} tokens is longer than the model's context of {self.context}")
        out: torch.Tensor = self.token(tokens) + self.position[:length]
        return out


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attention(ln(x))``, then ``x + mlp(ln(x))`` (MLP 4x wide, GELU)."""

    def __init__(self, *, width: int, heads: int, depth: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        for linear in (self.qkv, self.proj, self.fc1, self.fc2):
            nn.init.normal_(linear.weight, std=_INIT_STD)
            nn.init.zeros_(linear.bias)
        # GPT-2: the layers that write into the residual stream shrink with depth, so that its variance does not
        # grow with the number of blocks (2 writes per block).
        for linear in (self.proj, self.fc2):
            nn.init.normal_(linear.weight, std=_INIT_STD / math.sqrt(2 * depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, T, d]`` to ``[N, T, d]``; position t attends to positions 0..t."""
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, t, d))
        out: torch.Tensor = x + self.fc2(functional.gelu(self.fc1(self.ln2(x))))
        return out


class Head(nn.Module):
    """Final LayerNorm and the projection to next-token scores ``[N, T, vocab]``."""

    def __init__(self, *, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)
        nn.init.normal_(self.out.weight, std=_INIT_STD)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scores over the vocabulary at every position."""
        out: torch.Tensor = self.out(self.ln(x))
        return out


def transformer(*, vocab: int, context: int, width: int = 128, heads: int = 4, depth: int = 6) -> nn.Sequential:
    """``nn.Sequential(Embed, depth x Block, Head)``: a causal character-level language model.

    The defaults (d = 128, 4 heads, 6 blocks, about 1.2 M parameters) train on a 2-core CPU in minutes per
    epoch of :mod:`paratrain.train.data`'s fortunes, and give a pipeline 8 top-level layers, 6 of them equal.

    Example:
        >>> model = transformer(vocab=10, context=8, width=16, heads=2, depth=2)
        >>> model(torch.zeros(3, 8, dtype=torch.long)).shape
        torch.Size([3, 8, 10])
    """
    return nn.Sequential(
        Embed(vocab=vocab, context=context, width=width),
        *(Block(width=width, heads=heads, depth=depth) for _ in range(depth)),
        Head(width=width, vocab=vocab),
    )
