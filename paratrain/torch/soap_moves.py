"""The moves between split layers as autograd functions: forward the move of an activation over a tensor group
(:class:`paratrain.soap.Move`), backward the move of its gradient. What :mod:`paratrain.torch.soap` runs between
steps of a chain and :mod:`paratrain.torch.soap_blocks` inside a transformer block (Megatron's ``f`` and ``g``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paratrain.runtime.group import Group
from paratrain.soap import Move

__all__ = ["_Boundary", "_channels_first", "_part"]


def _part(total: int, parts: int, index: int) -> slice:
    """Part ``index`` of ``parts`` equal parts of ``range(total)`` (``total`` divides by ``parts``)."""
    size = total // parts
    return slice(index * size, (index + 1) * size)


def _channels_first(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``x`` with dimension ``dim`` (features, or a convolution's channels) first, contiguous: the collectives
    split and join along axis 0."""
    return x.movedim(dim, 0).contiguous()


def _back(x: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`_channels_first` undone."""
    return x.movedim(0, dim).contiguous()


def _run(step: Move, x: torch.Tensor, group: Group, index: int, dim: int = 1) -> torch.Tensor:
    """``step`` applied to ``x`` (``[batch, features]`` or ``[batch, channels, ...]``, split along dimension
    ``dim``: 1, or -1 for the last) over ``group``, whose member ``index`` this worker is."""
    dim %= x.dim()
    if step is Move.NONE:
        return x
    if step is Move.SLICE:
        return x.narrow(dim, index * (x.shape[dim] // group.world_size), x.shape[dim] // group.world_size).contiguous()
    if step is Move.ALLREDUCE:
        return group.allreduce(x.contiguous())
    if step is Move.ALLGATHER:
        return _back(group.allgather(_channels_first(x, dim)), dim)
    return _back(group.reduce_scatter(_channels_first(x, dim)), dim)  # REDUCE_SCATTER


@dataclass(frozen=True, slots=True)
class _Boundary:
    """The moves at one boundary of the chain, over ``group`` (this worker is its member ``index``)."""

    forward: Move
    backward: Move
    group: Group
    index: int
    dim: int = 1

    def cross(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` moved forward; its gradient moves backward (``x`` itself where neither moves: no autograd node,
        which costs tens of microseconds a step per boundary)."""
        if self.forward is Move.NONE and self.backward is Move.NONE:
            return x
        out: torch.Tensor = _Moved.apply(x, self)  # type: ignore[no-untyped-call]
        return out


class _Moved(torch.autograd.Function):
    """The forward move of an activation, and the backward move of its gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, boundary: _Boundary) -> torch.Tensor:
        ctx.boundary = boundary
        return _run(boundary.forward, x, boundary.group, boundary.index, boundary.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        b: _Boundary = ctx.boundary
        return _run(b.backward, grad, b.group, b.index, b.dim), None
