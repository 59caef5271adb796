"""Bandwidth-bound collectives: pipelined ring reduce-scatter/allgather/allreduce and chain broadcast.

Each chunk of a ring is cut into segments of about :data:`~.lower.SEGMENT_BYTES`, and each segment is
forwarded the moment it has arrived and been reduced, so the transport's threads overlap the network with
numpy's reductions. The segments, the order and the buffer reuse are all in the plan (:func:`.lower.ring_into`,
:func:`.lower.chain_broadcast_into`); these functions take their rank's part of the call's plan (the same
cached object the cost model replays and the tests record) and run it through :func:`.execute.run_actions`.
Buffers are never copied on the way out: sends borrow slices of the caller's arrays, and a slice is written
again only after the transport has released it.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from paratrain.collectives.exchange import Exchange
from paratrain.collectives.execute import run_actions
from paratrain.collectives.lower import (
    SEGMENT_BYTES,
    allgather_plan,
    broadcast_plan,
    reduce_scatter_plan,
    segment_bounds,
)
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.ops import Reducer

__all__ = [
    "SEGMENT_BYTES",
    "chain_broadcast_run",
    "ring_allgather_run",
    "ring_allreduce_run",
    "ring_reduce_scatter_run",
    "segment_bounds",
]


def ring_allreduce_run(
    ex: Exchange,
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    reducer: Reducer,
    *,
    segment_bytes: int | None = None,
) -> None:
    """Allreduce of flat ``src`` into flat ``dst`` (``dst`` may be ``src``): pipelined ring, any length and N.

    ``src`` is only read (and only as long as the call runs). Every rank ends with identical bits: each chunk
    is reduced once, in ring order, by the rank that then owns it, and the allgather copies it verbatim.
    Blocks until done. See :func:`~paratrain.collectives.plans.ring_allreduce` for the cost.

    Example:
        >>> import numpy as np
        >>> from paratrain.collectives.ops import Reducer
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     x = np.arange(5.0) * (ctx.rank + 1)
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         ring_allreduce_run(ex, x, x, Reducer("sum", "float64"), segment_bytes=16)
        ...     return x.tolist()
        >>> run_ranks(3, rank_fn)[2]
        [0.0, 6.0, 12.0, 18.0, 24.0]
    """
    n = ex.world_size
    plan = allreduce_plan(
        "ring", n, src.size, src.itemsize, aliased=dst is src, segment_bytes=segment_bytes, agreement=False
    )
    actions = plan.ranks[ex.rank]
    run_actions(ex, actions, {"src": src, "dst": dst}, reducer, dst.dtype)


def ring_reduce_scatter_run(
    ex: Exchange,
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    bounds: list[tuple[int, int]],
    reducer: Reducer,
    *,
    segment_bytes: int | None = None,
) -> None:
    """Ring reduce-scatter: afterwards ``dst[bounds[rank]]`` holds chunk ``rank`` reduced over all ranks.

    ``bounds`` are the N chunks as flat ``[start, stop)`` (e.g. whole rows). Other parts of ``dst`` hold
    partial results. Blocks until done.

    Example:
        >>> import numpy as np
        >>> from paratrain.collectives.ops import Reducer
        >>> from paratrain.collectives.plans import chunk_bounds
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     x, out = np.ones(5, dtype=np.int64), np.zeros(5, dtype=np.int64)
        ...     bounds = chunk_bounds(5, ctx.world_size)
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         ring_reduce_scatter_run(ex, x, out, bounds, Reducer("sum", "int64"))
        ...     return out[slice(*bounds[ctx.rank])].tolist()
        >>> run_ranks(2, rank_fn)
        [[2, 2, 2], [2, 2]]
    """
    plan = reduce_scatter_plan(
        ex.world_size, tuple(bounds), src.itemsize, segment_bytes=segment_bytes, aliased=dst is src, agreement=False
    )
    actions = plan.ranks[ex.rank]
    run_actions(ex, actions, {"src": src, "dst": dst}, reducer, dst.dtype)


def ring_allgather_run(
    ex: Exchange, buf: npt.NDArray[Any], bounds: list[tuple[int, int]], *, segment_bytes: int | None = None
) -> None:
    """Ring allgather in place: ``buf[bounds[rank]]`` holds this rank's block; afterwards all blocks are there.

    Blocks may differ in length (the caller agreed on ``bounds`` beforehand). Blocks until done.

    Example:
        >>> import numpy as np
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     buf = np.zeros(3)
        ...     bounds = [(0, 1), (1, 3)]  # rank 0 contributes one item, rank 1 two
        ...     buf[slice(*bounds[ctx.rank])] = ctx.rank + 1
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         ring_allgather_run(ex, buf, bounds)
        ...     return buf.tolist()
        >>> run_ranks(2, rank_fn)
        [[1.0, 2.0, 2.0], [1.0, 2.0, 2.0]]
    """
    plan = allgather_plan(ex.world_size, tuple(bounds), buf.itemsize, segment_bytes=segment_bytes, agreement=False)
    actions = plan.ranks[ex.rank]
    run_actions(ex, actions, {"src": buf, "dst": buf}, None, buf.dtype)


def chain_broadcast_run(
    ex: Exchange,
    dst: npt.NDArray[Any],
    *,
    root: int,
    source: npt.NDArray[Any] | None = None,
    segment_bytes: int | None = None,
) -> None:
    """Pipelined chain broadcast of the root's flat ``source`` into every rank's flat ``dst``.

    Each received segment is forwarded to the next rank before it is copied into ``dst``. Bandwidth-optimal
    for large arrays (see :func:`~paratrain.collectives.plans.chain_broadcast`). Blocks until done.

    Example:
        >>> import numpy as np
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     out = np.zeros(4)
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         chain_broadcast_run(ex, out, root=1, source=np.arange(4.0), segment_bytes=8)
        ...     return out.tolist()
        >>> run_ranks(3, rank_fn)[0]
        [0.0, 1.0, 2.0, 3.0]
    """
    is_root = ex.rank == root
    if is_root:
        assert source is not None, "the root of a broadcast needs a source"
    plan = broadcast_plan(
        "chain",
        ex.world_size,
        dst.size,
        dst.itemsize,
        root=root,
        segment_bytes=segment_bytes,
        aliased=source is dst,
        agreement=False,
    )
    run_actions(ex, plan.ranks[ex.rank], {"src": dst if source is None else source, "dst": dst}, None, dst.dtype)
