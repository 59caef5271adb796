"""A transformer's modules split over a tensor group: blocks by their heads (Megatron-LM's tensor-parallel
transformer layer), and the token embedding and output head by vocabulary.

A pre-norm block (``x + proj(attention(qkv(ln1(x))))``, then ``x + fc2(gelu(fc1(ln2(x))))``) keeps on each of N
workers its N-th of the attention heads (their rows of the query, key and value projections, the attention of
those heads, the matching columns of the output projection) and of the MLP's width (rows of ``fc1``, columns of
``fc2``); the layer norms stay whole. Two moves per half, Megatron's ``f`` and ``g``: the normalised input enters
the split part as it is and its gradient is all-reduced (``f``); the part's partial output is all-reduced and its
gradient passes as it is (``g``). The biases of the two layers whose outputs are all-reduced live on the group's
first worker. Recognised by shape (``heads``, ``ln1``, ``qkv``, ``proj``, ``ln2``, ``fc1``, ``fc2``), as
:class:`paratrain.train.transformer.Block` has them; an embedding (``token``, ``position``) and a head (``ln``,
``out``) as :class:`~paratrain.train.transformer.Embed` and :class:`~paratrain.train.transformer.Head` have them.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from paratrain.runtime.group import Group
from paratrain.soap import LayerShape, Move
from paratrain.torch.soap_moves import _Boundary

__all__ = ["SplitBlock", "SplitEmbed", "SplitHead", "block_shape", "vocab_shape"]

_PARTS = ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")


def block_shape(module: nn.Module) -> LayerShape | None:
    """A transformer block's heads and MLP width (what a split by heads cuts), or None for another module."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in _PARTS):
        return None
    heads = getattr(module, "heads", None)
    fc1 = getattr(module, "fc1", None)
    if not isinstance(heads, int) or not isinstance(fc1, nn.Linear):
        return None
    return LayerShape(heads, fc1.out_features, kind="block")


def _rows(total: int, parts: int, index: int) -> slice:
    size = total // parts
    return slice(index * size, (index + 1) * size)


class SplitBlock(nn.Module):
    """This worker's part of ``block`` split by heads over ``group`` (the tensor group; this worker is its
    ``group.rank``)."""

    def __init__(self, block: nn.Module, group: Group, *, sequence: bool = False) -> None:
        super().__init__()
        shape = block_shape(block)
        if shape is None:
            raise TypeError(f"{type(block).__name__} is not a transformer block (heads, ln1, qkv, proj, ln2, fc1, fc2)")
        qkv, proj, fc1, fc2 = (cast(nn.Linear, getattr(block, n)) for n in ("qkv", "proj", "fc1", "fc2"))
        width = qkv.in_features
        parts, index = group.world_size, group.rank
        self.parts, self.index, self.group = parts, index, group
        self.heads, self.head_width = shape.in_features // parts, width // shape.in_features
        self.ln1 = copy.deepcopy(cast(nn.Module, block.ln1))
        self.ln2 = copy.deepcopy(cast(nn.Module, block.ln2))
        mine = _rows(width, parts, index)
        qkv_rows = torch.cat([torch.arange(width)[mine] + s * width for s in range(3)])  # this part's q, k and v
        hidden = _rows(fc1.out_features, parts, index)
        first = index == 0

        def keep(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().clone())

        self.qkv_weight, self.qkv_bias = keep(qkv.weight[qkv_rows]), keep(qkv.bias[qkv_rows])
        self.proj_weight = keep(proj.weight[:, mine])
        self.proj_bias = keep(proj.bias) if first else None
        self.fc1_weight, self.fc1_bias = keep(fc1.weight[hidden]), keep(fc1.bias[hidden])
        self.fc2_weight = keep(fc2.weight[:, hidden])
        self.fc2_bias = keep(fc2.bias) if first else None
        self.sequence = sequence
        # set by the chain when the block before (after) is split along the sequence too: the activation between
        # them stays split along the positions, and neither gathers it (Megatron's sequence parallelism)
        self.sharded_in = self.sharded_out = False
        if sequence:  # the f and g of Megatron's sequence parallelism: along the positions (dimension 1)
            self._f = _Boundary(Move.ALLGATHER, Move.REDUCE_SCATTER, group, index)
            self._g = _Boundary(Move.REDUCE_SCATTER, Move.ALLGATHER, group, index)
            self._enter = _Boundary(Move.SLICE, Move.ALLGATHER, group, index)
            self._leave = _Boundary(Move.ALLGATHER, Move.SLICE, group, index)
        else:
            self._f = _Boundary(Move.NONE, Move.ALLREDUCE, group, index)  # Megatron's f
            self._g = _Boundary(Move.ALLREDUCE, Move.NONE, group, index)  # Megatron's g
        self._width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        if self.sequence and not self.sharded_in:
            if t % self.parts:
                raise ValueError(
                    f"a block split by {self.parts} along the sequence needs windows whose length divides by "
                    f"{self.parts}, got {t}"
                )
            x = self._enter.cross(x)  # this worker's positions: its layer norms and residuals see only them
        h = self._f.cross(self.ln1(x))
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias).view(n, h.shape[1], 3, self.heads, self.head_width)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, h.shape[1], -1)
        x = x + self._g.cross(F.linear(attended, self.proj_weight, self.proj_bias))
        h = self._f.cross(self.ln2(x))
        mlp = F.linear(F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias)), self.fc2_weight, self.fc2_bias)
        out: torch.Tensor = x + self._g.cross(mlp)
        return self._leave.cross(out) if self.sequence and not self.sharded_out else out

    def partial_gradients(self) -> list[torch.Tensor]:
        """The gradients that are each worker's share of the whole (split along the sequence: the layer norms'),
        to be summed over the tensor group before the optimizer steps."""
        if not self.sequence:
            return []
        return [p.grad for p in (*self.ln1.parameters(), *self.ln2.parameters()) if p.grad is not None]

    def whole(self, *, grads: bool = False) -> dict[str, np.ndarray[Any, Any]]:
        """The unsplit block's parameters (or their gradients) under its own names (``qkv.weight``...), from every
        part. Collective over the tensor group."""
        group, parts, width = self.group, self.parts, self._width

        def value(p: nn.Parameter | None, like: int = 0) -> torch.Tensor:
            if p is None:  # a bias kept by the first part only
                return torch.zeros(like, dtype=self.qkv_weight.dtype)
            got = p.grad if grads else p
            assert got is not None, "no gradient yet"
            return got.detach().contiguous()

        def by_rows(p: nn.Parameter | None) -> torch.Tensor:
            return group.allgather(value(p))

        def by_columns(p: nn.Parameter | None) -> torch.Tensor:
            return group.allgather(value(p).t().contiguous()).t().contiguous()

        qkv_w = by_rows(self.qkv_weight).view(parts, 3, width // parts, width).transpose(0, 1).reshape(3 * width, width)
        qkv_b = by_rows(self.qkv_bias).view(parts, 3, width // parts).transpose(0, 1).reshape(3 * width)
        found = {
            "qkv.weight": qkv_w,
            "qkv.bias": qkv_b,
            "proj.weight": by_columns(self.proj_weight),
            "proj.bias": group.broadcast(value(self.proj_bias, width), root=0),
            "fc1.weight": by_rows(self.fc1_weight),
            "fc1.bias": by_rows(self.fc1_bias),
            "fc2.weight": by_columns(self.fc2_weight),
            "fc2.bias": group.broadcast(value(self.fc2_bias, width), root=0),
        }
        for ln in ("ln1", "ln2"):
            for name, param in getattr(self, ln).named_parameters():
                found[f"{ln}.{name}"] = value(param)
        return {k: v.contiguous().numpy().copy() for k, v in found.items()}

    def extra_repr(self) -> str:
        along = ", and the sequence" if self.sequence else ""
        return f"heads {self.heads} of {self.heads * self.parts}{along}, part={self.index}/{self.parts}"


def vocab_shape(module: nn.Module) -> LayerShape | None:
    """The vocabulary of a token embedding (a module with ``token``, an ``nn.Embedding``, and ``position``) or an
    output head (exactly ``ln`` and ``out``, a LayerNorm and a Linear), what a split by vocabulary cuts; None for
    another module."""
    token = getattr(module, "token", None)
    if isinstance(token, nn.Embedding) and isinstance(getattr(module, "position", None), nn.Parameter):
        return LayerShape(token.num_embeddings, token.num_embeddings, kind="vocab")
    children = dict(module.named_children())
    out = children.get("out")
    if set(children) == {"ln", "out"} and isinstance(children["ln"], nn.LayerNorm) and isinstance(out, nn.Linear):
        return LayerShape(out.out_features, out.out_features, kind="vocab")
    return None


class SplitEmbed(nn.Module):
    """This worker's rows of a token embedding split by vocabulary over ``group`` (Megatron's vocabulary-parallel
    embedding): a token outside its rows looks up zeros, the parts' sum (one allreduce forward) is every
    token's row; the position embedding stays whole."""

    def __init__(self, embed: nn.Module, group: Group) -> None:
        super().__init__()
        token = cast(nn.Embedding, embed.token)
        rows = _rows(token.num_embeddings, group.world_size, group.rank)
        self.start, self.stop, self.group = rows.start, rows.stop, group
        self.context = int(getattr(embed, "context", 0))
        self.token_weight = nn.Parameter(token.weight[rows].detach().clone())
        self.position = nn.Parameter(cast(nn.Parameter, embed.position).detach().clone())
        self._g = _Boundary(Move.ALLREDUCE, Move.NONE, group, group.rank)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if self.context and length > self.context:
            raise ValueError(f"a window of {length} tokens is longer than the model's context of {self.context}")
        mine = (tokens >= self.start) & (tokens < self.stop)
        local = F.embedding(torch.where(mine, tokens - self.start, 0), self.token_weight) * mine.unsqueeze(-1)
        out: torch.Tensor = self._g.cross(local) + self.position[:length]
        return out

    def whole(self, *, grads: bool = False) -> dict[str, np.ndarray[Any, Any]]:
        """The unsplit embedding's ``token.weight`` and ``position`` (or gradients); collective over the group."""
        token = self.token_weight.grad if grads else self.token_weight
        position = self.position.grad if grads else self.position
        assert token is not None and position is not None, "no gradient yet"
        full = self.group.allgather(token.detach().contiguous())
        return {"token.weight": full.numpy().copy(), "position": position.detach().numpy().copy()}

    def extra_repr(self) -> str:
        return f"tokens {self.start}..{self.stop - 1}, part={self.group.rank}/{self.group.world_size}"


class SplitHead(nn.Module):
    """This worker's part of an output head (``ln``, then ``out`` to the vocabulary) split by vocabulary over
    ``group``: the layer norm whole, the output layer's rows for this part's tokens (a column split), its scores
    gathered along the last dimension; the normalised input's gradient all-reduced (Megatron's ``f``)."""

    def __init__(self, head: nn.Module, group: Group) -> None:
        super().__init__()
        out = cast(nn.Linear, head.out)
        rows = _rows(out.out_features, group.world_size, group.rank)
        self.group = group
        self.ln = copy.deepcopy(cast(nn.Module, head.ln))
        self.out_weight = nn.Parameter(out.weight[rows].detach().clone())
        self.out_bias = nn.Parameter(out.bias[rows].detach().clone()) if out.bias is not None else None
        self._f = _Boundary(Move.NONE, Move.ALLREDUCE, group, group.rank)
        self._gather = _Boundary(Move.ALLGATHER, Move.SLICE, group, group.rank, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self._gather.cross(F.linear(self._f.cross(self.ln(x)), self.out_weight, self.out_bias))
        return scores

    def whole(self, *, grads: bool = False) -> dict[str, np.ndarray[Any, Any]]:
        """The unsplit head's parameters (or gradients) under its names; collective over the group."""
        found: dict[str, torch.Tensor] = {}
        for name, param in (("out.weight", self.out_weight), ("out.bias", self.out_bias)):
            if param is not None:
                value = param.grad if grads else param
                assert value is not None, "no gradient yet"
                found[name] = self.group.allgather(value.detach().contiguous())
        for name, param in self.ln.named_parameters():
            value = param.grad if grads else param
            assert value is not None, "no gradient yet"
            found[f"ln.{name}"] = value.detach()
        return {k: v.contiguous().numpy().copy() for k, v in found.items()}
