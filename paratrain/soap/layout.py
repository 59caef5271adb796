"""How a ``[batch, features]`` activation lies over a tensor-parallel group, and the collective between two layouts.

Three layouts over a group of N workers (FlexFlow's parameter dimension; Megatron-LM's column and row parallelism):

- ``REPLICATED``: every worker holds all of it;
- ``SHARDED``: worker i holds the features ``numpy.array_split(range(features), N)[i]``;
- ``PARTIAL``: every worker holds a summand, the activation is their sum (a row-parallel layer's output).

A layer's split fixes the layout it reads, the one it writes, and the layout of the gradient it returns for its
input. A column-parallel layer (output features split) reads the whole input and writes a shard; the gradient it
returns for its input is partial (each shard of weights contributes a summand). A row-parallel layer (input
features split) reads a shard, writes a partial sum, and returns the gradient of its shard. The gradient that
reaches a layer's output has the layout *dual* to what it wrote: a shard's gradient is sharded, a partial sum's
gradient is the whole gradient of the sum (replicated).

So one table, :func:`move`, serves both directions: forward it turns what a layer wrote into what the next reads;
backward it turns the gradient the next layer returned into the gradient the previous one expects. Megatron's
``f`` (identity forward, allreduce backward) and ``g`` (allreduce forward, identity backward) are two of its
entries. :func:`plan_chain` applies it to a chain of layers and element-wise functions; the torch front end
executes the plan it returns, and tests compare it with exact tables.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SPLITS", "ChainPlan", "Layout", "Move", "OpSpec", "move", "plan_chain"]


class Layout(enum.Enum):
    """How an activation (or its gradient) lies over the tensor-parallel group."""

    REPLICATED = "replicated"
    SHARDED = "sharded"
    PARTIAL = "partial"


class Move(enum.Enum):
    """The collective (or local step) that turns one layout into another, over the tensor-parallel group."""

    NONE = "none"
    ALLGATHER = "allgather"  # shards -> the whole (concatenated along features)
    ALLREDUCE = "allreduce"  # summands -> the whole sum
    REDUCE_SCATTER = "reduce_scatter"  # summands -> this worker's shard of the sum
    SLICE = "slice"  # the whole -> this worker's shard (local, no message)


_MOVES = {
    (Layout.REPLICATED, Layout.REPLICATED): Move.NONE,
    (Layout.REPLICATED, Layout.SHARDED): Move.SLICE,
    (Layout.SHARDED, Layout.REPLICATED): Move.ALLGATHER,
    (Layout.SHARDED, Layout.SHARDED): Move.NONE,
    (Layout.PARTIAL, Layout.REPLICATED): Move.ALLREDUCE,
    (Layout.PARTIAL, Layout.SHARDED): Move.REDUCE_SCATTER,
}

#: How a linear layer may be split: its input layout, output layout and the layout of its input's gradient.
SPLITS: dict[str, tuple[Layout, Layout, Layout]] = {
    "replicated": (Layout.REPLICATED, Layout.REPLICATED, Layout.REPLICATED),
    "column": (Layout.REPLICATED, Layout.SHARDED, Layout.PARTIAL),  # output features split
    "row": (Layout.SHARDED, Layout.PARTIAL, Layout.SHARDED),  # input features split
}


def move(src: Layout, dst: Layout) -> Move:
    """What turns ``src`` into ``dst``.

    Raises:
        ValueError: ``dst`` is PARTIAL: no layer reads a partial sum (a sum must be reduced before use).

    Example:
        >>> move(Layout.PARTIAL, Layout.REPLICATED).value
        'allreduce'
    """
    found = _MOVES.get((src, dst))
    if found is None:
        raise ValueError(f"no layer reads a {dst.value} activation (from {src.value})")
    return found


def _dual(written: Layout) -> Layout:
    """The layout of the gradient that reaches an output written as ``written``."""
    return Layout.REPLICATED if written is Layout.PARTIAL else written


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One step of a chain: a linear layer with its split, or an element-wise function (``split`` None)."""

    name: str
    split: str | None


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """The moves of a chain of layers.

    Attributes:
        ops: the chain's steps, in order.
        layouts: the layout each step reads (an element-wise step writes what it reads).
        forward: ``forward[i]``: the move before step i (from what step i-1 wrote; the input is replicated);
            ``forward[len(ops)]`` makes the output whole for the loss.
        backward: ``backward[i]``: the move of the gradient step i returns for its input into what step i-1
            expects (``backward[0]`` is NONE: the input needs no gradient); ``backward[len(ops)]`` is the loss
            gradient's (whole) into what the last step expects.
    """

    ops: tuple[OpSpec, ...]
    layouts: tuple[Layout, ...]
    forward: tuple[Move, ...]
    backward: tuple[Move, ...]

    def names(self) -> list[str]:
        """The steps' names, in order."""
        return [op.name for op in self.ops]

    def messages(self) -> int:
        """Collectives one training step runs over the tensor-parallel group (a SLICE sends nothing)."""
        moves = [*self.forward, *self.backward]
        return sum(1 for m in moves if m not in (Move.NONE, Move.SLICE))


def plan_chain(ops: Sequence[OpSpec]) -> ChainPlan:
    """The layouts and moves of a chain read from a replicated input and ending in a replicated output.

    An element-wise step (ReLU...) reads what the step before wrote, except a partial sum, which a non-linear
    function cannot take: it is reduced first, into the layout the next linear step reads (or whole at the end).

    Raises:
        ValueError: an unknown split.

    Example:
        >>> p = plan_chain([OpSpec("0", "column"), OpSpec("1", None), OpSpec("2", "row")])
        >>> [m.value for m in p.forward], [m.value for m in p.backward]
        (['none', 'none', 'none', 'allreduce'], ['none', 'none', 'none', 'none'])
    """
    for op in ops:
        if op.split is not None and op.split not in SPLITS:
            raise ValueError(f"{op.name}: unknown split {op.split!r}; one of {', '.join(SPLITS)}")
    reads: list[Layout] = []
    writes: list[Layout] = []
    returns: list[Layout] = []  # the layout of the gradient each step returns for its input
    written = Layout.REPLICATED
    for i, op in enumerate(ops):
        if op.split is not None:
            read, write, grad = SPLITS[op.split]
        else:
            read = written if written is not Layout.PARTIAL else _next_read(ops, i)
            write, grad = read, read
        reads.append(read)
        writes.append(write)
        returns.append(grad)
        written = write
    forward = [move(Layout.REPLICATED, reads[0])] if ops else []
    forward += [move(writes[i - 1], reads[i]) for i in range(1, len(ops))]
    forward.append(move(written, Layout.REPLICATED))
    backward = [Move.NONE] if ops else []
    backward += [move(returns[i], _dual(writes[i - 1])) for i in range(1, len(ops))]
    backward.append(move(Layout.REPLICATED, _dual(written)))
    return ChainPlan(tuple(ops), tuple(reads), tuple(forward), tuple(backward))


def _next_read(ops: Sequence[OpSpec], i: int) -> Layout:
    """What the next linear step after ``i`` reads (whole if none follows)."""
    for op in ops[i + 1 :]:
        if op.split is not None:
            return SPLITS[op.split][0]
    return Layout.REPLICATED
