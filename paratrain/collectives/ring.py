"""Bandwidth-bound collectives: pipelined ring reduce-scatter/allgather/allreduce and chain broadcast.

The ring plans of :mod:`paratrain.collectives.plans` move whole chunks; here every chunk is cut further into
segments of about :data:`SEGMENT_BYTES`, and each segment is forwarded the moment it has arrived and been
reduced. So while this rank reduces segment k, segment k - 1 is on its way to the right neighbour and segment
k + 1 is arriving from the left one, and the transport's threads (ZeroMQ's I/O and receiver threads) overlap
the network with numpy's reductions::

    time ->     seg 0         seg 1         seg 2
    recv    |===========|===========|===========|
    reduce              |====|      |====|      |====|
    send                     |===========|===========|===========|

Buffers are never copied on the way out: sends borrow slices of the caller's arrays (ZeroMQ zero-copy), and a
slice is written again only after the transport has released it. Received segments (read-only views of
network frames) are reduced straight into the destination.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.ops import Reducer
from paratrain.collectives.plans import (
    RingStep,
    chain_broadcast,
    chunk_bounds,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)
from paratrain.collectives.tree import Exchange
from paratrain.transport.base import Handle

__all__ = [
    "SEGMENT_BYTES",
    "chain_broadcast_run",
    "ring_allgather_run",
    "ring_allreduce_run",
    "ring_reduce_scatter_run",
    "segment_bounds",
]

#: Pipelining unit of the ring and chain executors, in bytes. Smaller segments start the pipeline sooner and
#: overlap more of the transfer with the reduction, but each costs a message: a header, a receiver-thread
#: hand-off and a Python round of bookkeeping, 0.1-0.3 ms on the ZeroMQ transport of a 2-core VM. Measured
#: there for a 16 MiB float32 allreduce between 2 processes (median ms): 512 KiB 19.3, 1 MiB 17.8, 2 MiB 14.3,
#: 4 MiB 14.9. Tune on the target machine; the executors also take ``segment_bytes=``.
SEGMENT_BYTES = 1 << 21


def segment_bounds(start: int, stop: int, segment: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into pieces of at most ``segment`` items (none if empty).

    Example:
        >>> segment_bounds(10, 25, 6)
        [(10, 16), (16, 22), (22, 25)]
    """
    return [(a, min(a + segment, stop)) for a in range(start, stop, max(segment, 1))]


def _segment_items(itemsize: int, segment_bytes: int | None) -> int:
    return max(1, (SEGMENT_BYTES if segment_bytes is None else segment_bytes) // max(itemsize, 1))


def _ring_pass(
    ex: Exchange,
    *,
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    bounds: list[tuple[int, int]],
    plan: list[RingStep],
    reduce_steps: int,
    reducer: Reducer | None,
    segment: int,
) -> None:
    """Executes a ring plan whose every step sends the chunk received in the step before.

    Steps ``< reduce_steps`` combine the received segment with ``src`` into ``dst`` (each chunk is received at
    most once during them, so ``src`` still holds this rank's own data there) and forward the result; later
    steps forward the received segment as it is and copy it into ``dst``. Step 0 sends from ``src``.
    """
    if not plan:
        return
    segs = [segment_bounds(a, b, segment) for a, b in bounds]
    inflight: dict[tuple[int, int], Handle[None]] = {}  # (chunk, segment) -> the send still reading it
    first = plan[0]
    for k, (a, b) in enumerate(segs[first.send_chunk]):
        inflight[(first.send_chunk, k)] = ex.send(first.send_to, [src[a:b]])
    for s, step in enumerate(plan):
        chunk = step.recv_chunk
        posted = [ex.post(step.recv_from) for _ in segs[chunk]]
        forward_to = plan[s + 1].send_to if s + 1 < len(plan) else None
        for k, (a, b) in enumerate(segs[chunk]):
            data = ex.recv_array(posted[k], step.recv_from, b - a, dst.dtype)
            out = dst[a:b]
            busy = inflight.pop((chunk, k), None)
            if busy is not None:
                ex.wait_sent(busy)
            if s < reduce_steps:
                assert reducer is not None
                reducer.combine(src[a:b], data, out)
                if s == reduce_steps - 1:
                    reducer.finish(out, ex.world_size)
                if forward_to is not None:
                    inflight[(chunk, k)] = ex.send(forward_to, [out])
            else:
                if forward_to is not None:
                    ex.send(forward_to, [data])  # forward the received frame itself: the copy leaves the critical path
                np.copyto(out, data)
    ex.finish()


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
    _ring_pass(
        ex,
        src=src,
        dst=dst,
        bounds=chunk_bounds(src.size, n),
        plan=ring_allreduce(ex.rank, n),
        reduce_steps=n - 1,
        reducer=reducer,
        segment=_segment_items(src.itemsize, segment_bytes),
    )


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
        >>> from paratrain.collectives.ops import Reducer
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
    _ring_pass(
        ex,
        src=src,
        dst=dst,
        bounds=bounds,
        plan=ring_reduce_scatter(ex.rank, ex.world_size),
        reduce_steps=ex.world_size - 1,
        reducer=reducer,
        segment=_segment_items(src.itemsize, segment_bytes),
    )


def ring_allgather_run(
    ex: Exchange, buf: npt.NDArray[Any], bounds: list[tuple[int, int]], *, segment_bytes: int | None = None
) -> None:
    """Ring allgather in place: ``buf[bounds[rank]]`` holds this rank's block; afterwards all blocks are there.

    Blocks may differ in length (the caller agreed on ``bounds`` beforehand). Blocks until done.

    Example:
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
    _ring_pass(
        ex,
        src=buf,
        dst=buf,
        bounds=bounds,
        plan=ring_allgather(ex.rank, ex.world_size),
        reduce_steps=0,
        reducer=None,
        segment=_segment_items(buf.itemsize, segment_bytes),
    )


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
        >>> from paratrain.testing import run_ranks
        >>> def rank_fn(ctx):
        ...     out = np.zeros(4)
        ...     with Exchange(ctx.transport, tag=1, timeout=10, label="demo") as ex:
        ...         chain_broadcast_run(ex, out, root=1, source=np.arange(4.0), segment_bytes=8)
        ...     return out.tolist()
        >>> run_ranks(3, rank_fn)[0]
        [0.0, 1.0, 2.0, 3.0]
    """
    steps = chain_broadcast(ex.rank, ex.world_size, root)
    recv_from = next((s.peer for s in steps if s.direction == "recv"), None)
    send_to = next((s.peer for s in steps if s.direction == "send"), None)
    segs = segment_bounds(0, dst.size, _segment_items(dst.itemsize, segment_bytes))
    if recv_from is None:
        assert source is not None, "the root of a broadcast needs a source"
        for a, b in segs:
            if send_to is not None:
                ex.send(send_to, [source[a:b]])
        if source is not dst:
            np.copyto(dst, source)
    else:
        posted = [ex.post(recv_from) for _ in segs]
        for (a, b), handle in zip(segs, posted, strict=True):
            data = ex.recv_array(handle, recv_from, b - a, dst.dtype)
            if send_to is not None:
                ex.send(send_to, [data])
            np.copyto(dst[a:b], data)
    ex.finish()
