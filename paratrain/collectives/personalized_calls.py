"""MPI's rooted and personalized collectives on :class:`~paratrain.collectives.api.Collectives`: reduce, gather,
scatter and all-to-all, blocking and async, on numpy arrays and torch tensors.

Each call goes the way the others do (:class:`~paratrain.collectives.calls.CollectiveCalls`): local checks, the
call's tag, the agreement (the same :class:`~paratrain.errors.CollectiveMismatchError` on every rank when the ranks'
calls differ), then its plan (:mod:`.lower_personalized`) run by the one executor; when every rank shares this
host (the shared-memory segment is on), gather, scatter and all-to-all move their blocks through the segment
instead (:meth:`~paratrain.collectives.shm.ShmGroup.publish`: each item copied in once and out once), and so
does a small reduce (:data:`SHM_REDUCE_MAX_BYTES`), whose root then combines the arrays in the tree's order.
Blocks may differ in size between ranks (their first dimension; the trailing ones and the dtype must agree):
gather takes each rank's rows as they are, scatter and all-to-all split along axis 0 by ``counts``
(``numpy.array_split`` by default), and the receivers learn the sizes from the agreement's payload. Results are
new arrays or tensors of the caller's type; a rooted call returns None on every rank but its root.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from paratrain.collectives.calls import CollectiveCalls
from paratrain.collectives.execute import run_actions
from paratrain.collectives.lower_personalized import alltoall_plan, gather_plan, reduce_to_plan, scatter_plan
from paratrain.collectives.ops import Reducer
from paratrain.collectives.plans import binomial_tree_reduce, chunk_bounds
from paratrain.collectives.signature import Signature
from paratrain.collectives.views import as_array, wrap
from paratrain.errors import MessageError
from paratrain.transport.base import Handle

__all__ = ["SHM_REDUCE_MAX_BYTES", "PersonalizedCalls"]

#: Largest reduce (bytes per rank) taken through the shared-memory segment: every rank's array copied to the root,
#: which then combines them in the tree's order (the same bits as the socket tree). Measured, 2 processes: 28-61
#: us through the segment against 160-186 us over sockets from 4 KiB to 64 KiB, but 346 against 275 us at 256 KiB
#: and 1.28 ms against 0.30 at 1 MiB (not understood yet; benchmarks/allreduce/README.md).
SHM_REDUCE_MAX_BYTES = 64 << 10

A = TypeVar("A")
Body = Callable[[int], Any]


class PersonalizedCalls(CollectiveCalls):
    """reduce, gather, scatter and all-to-all (see the module docstring)."""

    # -- reduce

    def reduce(self, x: A, root: int = 0, op: str = "sum", *, timeout: float | None = None) -> A | None:
        """Reduces ``x`` over all ranks with ``op`` (binomial tree); the result on ``root``, None elsewhere.

        Every rank passes an ``x`` of the same shape and dtype. Summation order: the tree's (for floats, not the
        rank order); ``"mean"`` divides once, at the root.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(3, lambda ctx: ctx.reduce(np.array([ctx.rank + 1]), root=1))
            [None, array([6]), None]
        """
        result: A | None = self._run(
            self._checked(lambda: self._prepare_reduce(x, root, op, timeout), timeout), "reduce", x
        )
        return result

    def reduce_async(self, x: A, root: int = 0, op: str = "sum", *, timeout: float | None = None) -> Handle[A | None]:
        """:meth:`reduce` on the background thread (``x`` is copied before this returns)."""
        prepare = self._checked(lambda: self._prepare_reduce(x, root, op, timeout, copy=True), timeout, "snapshot")
        return self._submit(prepare, "reduce", x)

    def _prepare_reduce(self, x: Any, root: int, op: str, timeout: float | None, *, copy: bool = False) -> Body:
        self._check_root(root)
        view, dtype_name = as_array(x, self._deadline(timeout))
        reducer = Reducer(op, dtype_name)
        src = view.reshape(-1).copy() if copy else view.reshape(-1)
        sig = Signature("reduce", op, dtype_name, view.shape, "tree", "tree", root)

        def body(tag: int) -> Any:
            rank, n = self.transport.rank, self.world_size
            dst = np.empty_like(src)
            if n == 1:
                np.copyto(dst, src)
            else:
                with self._exchange(tag, timeout, "reduce (tree)") as ex:
                    self._agree(ex, sig)
                    group = self._segment()
                    if group is not None and src.nbytes <= SHM_REDUCE_MAX_BYTES:  # through the segment
                        every = np.empty((n if rank == root else 0, src.size), dtype=src.dtype)
                        reads = [(q, 0, src.size, q * src.size) for q in range(n)] if rank == root else []
                        group.publish(src, [src.size] * n, reads, every.reshape(-1), timeout=max(ex.left(), 0.001))
                        if rank == root:
                            dst = _tree_sum(every, root, reducer)
                            reducer.finish(dst, n)
                    else:
                        plan = reduce_to_plan(n, src.size, src.itemsize, root=root, agreement=False)
                        run_actions(ex, plan.ranks[rank], {"src": src, "dst": dst}, reducer, dst.dtype)
            return wrap(x, dst.reshape(view.shape), dtype_name, self._deadline(timeout)) if rank == root else None

        return body

    # -- gather

    def gather(self, x: A, root: int = 0, *, timeout: float | None = None) -> A | None:
        """Concatenates every rank's ``x`` along axis 0 in rank order, on ``root``; None elsewhere.

        First dimensions may differ between ranks (0-d inputs count as one row); the others and the dtype must
        agree.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(3, lambda ctx: ctx.gather(np.arange(ctx.rank), root=2))
            [None, None, array([0, 0, 1])]
        """
        result: A | None = self._run(
            self._checked(lambda: self._prepare_gather(x, root, timeout), timeout), "gather", x
        )
        return result

    def gather_async(self, x: A, root: int = 0, *, timeout: float | None = None) -> Handle[A | None]:
        """:meth:`gather` on the background thread (``x`` is copied before this returns)."""
        prepare = self._checked(lambda: self._prepare_gather(x, root, timeout, copy=True), timeout, "snapshot")
        return self._submit(prepare, "gather", x)

    def _prepare_gather(self, x: Any, root: int, timeout: float | None, *, copy: bool = False) -> Body:
        self._check_root(root)
        view, dtype_name = as_array(x, self._deadline(timeout))
        trailing, row = view.shape[1:], math.prod(view.shape[1:])
        src = view.reshape(-1).copy() if copy else view.reshape(-1)
        sig = Signature("gather", None, dtype_name, view.shape, "linear", "linear", root)

        def body(tag: int) -> Any:
            rank, n = self.transport.rank, self.world_size
            if n == 1:
                rows, out = [view.shape[0] if view.ndim else 1], src.copy()
            else:
                with self._exchange(tag, timeout, "gather (linear)") as ex:
                    sigs = self._agree(ex, sig)
                    rows = [s.shape[0] if s.shape else 1 for s in sigs]
                    bounds = _bounds(rows, row)
                    out = np.empty(bounds[-1][1] if rank == root else 0, dtype=src.dtype)
                    group = self._segment()
                    if group is not None:  # every rank on this host: through the segment
                        reads = [(q, 0, b - a, a) for q, (a, b) in enumerate(bounds)] if rank == root else []
                        group.publish(src, [b - a for a, b in bounds], reads, out, timeout=max(ex.left(), 0.001))
                    else:
                        plan = gather_plan(n, bounds, src.itemsize, root=root, agreement=False)
                        run_actions(ex, plan.ranks[rank], {"src": src, "dst": out}, None, src.dtype)
            if rank != root:
                return None
            return wrap(x, out.reshape((sum(rows), *trailing)), dtype_name, self._deadline(timeout))

        return body

    # -- scatter

    def scatter(self, x: A, root: int = 0, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> A:
        """Splits ``root``'s ``x`` along axis 0 and returns rank r's part on rank r.

        ``counts``: the rows of each rank's part (read on the root only; ``numpy.array_split``'s by default: the
        first ``len(x) % world_size`` ranks get a row more). Elsewhere ``x`` only gives the dtype and the trailing
        dimensions (its rows are ignored: an empty array of the right kind will do).

        Raises:
            ValueError: ``x`` is 0-d, or (on the root) ``counts`` are not ``world_size`` non-negative rows that add
                up to ``len(x)``.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(2, lambda ctx: ctx.scatter(np.arange(5) * 10, counts=[1, 4]).tolist())
            [[0], [10, 20, 30, 40]]
        """
        result: A = self._run(
            self._checked(lambda: self._prepare_scatter(x, root, counts, timeout), timeout), "scatter", x
        )
        return result

    def scatter_async(
        self, x: A, root: int = 0, *, counts: Sequence[int] | None = None, timeout: float | None = None
    ) -> Handle[A]:
        """:meth:`scatter` on the background thread (``x`` is copied before this returns)."""
        prepare = self._checked(lambda: self._prepare_scatter(x, root, counts, timeout, copy=True), timeout, "snapshot")
        return self._submit(prepare, "scatter", x)

    def _prepare_scatter(
        self, x: Any, root: int, counts: Sequence[int] | None, timeout: float | None, *, copy: bool = False
    ) -> Body:
        self._check_root(root)
        view, dtype_name = as_array(x, self._deadline(timeout))
        if view.ndim == 0:
            raise ValueError("scatter splits along axis 0; a 0-d array has none")
        rank, n = self.transport.rank, self.world_size
        trailing, row = view.shape[1:], math.prod(view.shape[1:])
        mine = _split(view.shape[0], n, counts, "counts") if rank == root else [0] * n
        src = view.reshape(-1).copy() if copy and rank == root else view.reshape(-1)
        sig = Signature("scatter", None, dtype_name, view.shape, "linear", "linear", root)

        def body(tag: int) -> Any:
            if n == 1:
                part = src.copy()
            else:
                with self._exchange(tag, timeout, "scatter (linear)") as ex:
                    self._agree(ex, sig, np.asarray(mine, dtype=np.int64))
                    rows = _payload(ex.gathered, root, n, "scatter")
                    bounds = _bounds(rows, row)
                    part = np.empty(bounds[rank][1] - bounds[rank][0], dtype=src.dtype)
                    group = self._segment()
                    if group is not None:  # every rank on this host: through the segment
                        sizes = [bounds[-1][1] if q == root else 0 for q in range(n)]
                        reads = [(root, *bounds[rank], 0)]
                        group.publish(src, sizes, reads, part, timeout=max(ex.left(), 0.001))
                    else:
                        plan = scatter_plan(n, bounds, src.itemsize, root=root, agreement=False)
                        run_actions(ex, plan.ranks[rank], {"src": src, "dst": part}, None, src.dtype)
            return wrap(
                x, part.reshape((part.size // row if row else 0, *trailing)), dtype_name, self._deadline(timeout)
            )

        return body

    # -- all-to-all

    def alltoall(self, x: A, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> A:
        """Rank r sends part q of its ``x`` (split along axis 0) to rank q and returns what every rank sent it,
        concatenated in rank order.

        ``counts``: the rows this rank sends to each rank (``numpy.array_split``'s by default); ranks may split
        differently, and each learns what it receives from the agreement. Trailing dimensions and the dtype must
        agree. Pairwise exchange: N - 1 steps, each rank sending and receiving one part a step.

        Raises:
            ValueError: ``x`` is 0-d, or ``counts`` are not ``world_size`` non-negative rows adding up to ``len(x)``.

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> run_ranks(2, lambda ctx: ctx.alltoall(np.arange(3) + 10 * ctx.rank).tolist())
            [[0, 1, 10, 11], [2, 12]]
        """
        result: A = self._run(self._checked(lambda: self._prepare_alltoall(x, counts, timeout), timeout), "alltoall", x)
        return result

    def alltoall_async(self, x: A, *, counts: Sequence[int] | None = None, timeout: float | None = None) -> Handle[A]:
        """:meth:`alltoall` on the background thread (``x`` is copied before this returns)."""
        prepare = self._checked(lambda: self._prepare_alltoall(x, counts, timeout, copy=True), timeout, "snapshot")
        return self._submit(prepare, "alltoall", x)

    def _prepare_alltoall(
        self, x: Any, counts: Sequence[int] | None, timeout: float | None, *, copy: bool = False
    ) -> Body:
        view, dtype_name = as_array(x, self._deadline(timeout))
        if view.ndim == 0:
            raise ValueError("alltoall splits along axis 0; a 0-d array has none")
        rank, n = self.transport.rank, self.world_size
        trailing, row = view.shape[1:], math.prod(view.shape[1:])
        mine = _split(view.shape[0], n, counts, "counts")
        src = view.reshape(-1).copy() if copy else view.reshape(-1)
        sig = Signature("alltoall", None, dtype_name, view.shape, "pairwise", "pairwise")

        def body(tag: int) -> Any:
            if n == 1:
                out = src.copy()
            else:
                with self._exchange(tag, timeout, "alltoall (pairwise)") as ex:
                    self._agree(ex, sig, np.asarray(mine, dtype=np.int64))
                    sent = [_payload(ex.gathered, q, n, "alltoall") for q in range(n)]  # sent[q][r]: rows q -> r
                    send = [_bounds(sent[q], row) for q in range(n)]
                    recv = [_bounds([sent[q][r] for q in range(n)], row) for r in range(n)]
                    out = np.empty(recv[rank][-1][1], dtype=src.dtype)
                    group = self._segment()
                    if group is not None:  # every rank on this host: through the segment
                        sizes, reads, order = _alltoall_turns(send, recv, rank)
                        group.publish(src, sizes, reads, out, order=order, timeout=max(ex.left(), 0.001))
                    else:
                        plan = alltoall_plan(n, send, recv, itemsize=src.itemsize, agreement=False)
                        run_actions(ex, plan.ranks[rank], {"src": src, "dst": out}, None, src.dtype)
            rows = out.size // row if row else 0
            return wrap(x, out.reshape((rows, *trailing)), dtype_name, self._deadline(timeout))

        return body

    # -- shared

    def _check_root(self, root: int) -> None:
        if type(root) is not int or not 0 <= root < self.world_size:
            raise ValueError(f"root {root!r} outside 0..{self.world_size - 1}")


def _alltoall_turns(
    send: Sequence[Sequence[tuple[int, int]]], recv: Sequence[Sequence[tuple[int, int]]], rank: int
) -> tuple[list[int], list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """All-to-all through :meth:`~paratrain.collectives.shm.ShmGroup.publish`: rank q publishes its parts in the
    order q + 1, q + 2, ..., q (so that in every round each rank reads one peer's part, instead of every rank
    reading in turn); returns the published sizes, this rank's reads and its publishing order."""
    n = len(send)
    turns = [[(q + j) % n for j in range(1, n + 1)] for q in range(n)]
    starts = []
    for q in range(n):
        at, start = 0, {}
        for p in turns[q]:
            start[p] = at
            at += send[q][p][1] - send[q][p][0]
        starts.append(start)
    reads = [
        (q, starts[q][rank], starts[q][rank] + send[q][rank][1] - send[q][rank][0], recv[rank][q][0]) for q in range(n)
    ]
    return [send[q][-1][1] for q in range(n)], reads, [send[rank][p] for p in turns[rank]]


def _tree_sum(every: npt.NDArray[Any], root: int, reducer: Reducer) -> npt.NDArray[Any]:
    """Every rank's array (``every[q]``) combined at ``root`` in the binomial tree's order, as the socket path
    combines them (each rank: its own, then each child's subtree in the plan's order): the same bits."""
    n = len(every)

    def subtree(r: int) -> npt.NDArray[Any]:
        acc: npt.NDArray[Any] = every[r]  # (combined in place: the rows are this call's own copies)
        for step in binomial_tree_reduce(r, n, root):
            if step.direction == "recv":
                reducer.combine(acc, subtree(step.peer), acc)
        return acc

    return subtree(root)


def _split(rows: int, n: int, counts: Sequence[int] | None, name: str) -> list[int]:
    """Each rank's rows of ``rows``: ``counts`` checked, or numpy.array_split's."""
    if counts is None:
        return [b - a for a, b in chunk_bounds(rows, n)]
    split = list(counts)
    if len(split) != n or not all(type(c) is int and c >= 0 for c in split) or sum(split) != rows:
        raise ValueError(f"{name} must be {n} non-negative ints adding up to {rows} rows; got {split!r}")
    return split


def _bounds(rows: Sequence[int], row: int) -> tuple[tuple[int, int], ...]:
    """Consecutive blocks of ``rows[q] * row`` items, in order."""
    edges = np.cumsum([0, *rows]) * row
    return tuple((int(edges[q]), int(edges[q + 1])) for q in range(len(rows)))


def _payload(gathered: Sequence[npt.NDArray[Any] | None] | None, q: int, n: int, kind: str) -> list[int]:
    """The rows rank ``q``'s agreement payload lists (checked: it comes from a peer)."""
    got = gathered[q] if gathered is not None and q < len(gathered) else None
    if got is None or got.size != n or np.any(got < 0):
        raise MessageError(f"{kind}: a peer sent malformed counts in the agreement; do all ranks run one version?")
    return [int(c) for c in got]
