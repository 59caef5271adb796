"""Plans of the collectives whose ranks send different data to different ranks (MPI's gather, scatter and
all-to-all) and of the rooted reduce, in the plan IR (:mod:`paratrain.plan.ir`). Pure: no I/O.

Every plan works on flat buffers: ``src`` (what this rank contributes) and ``dst`` (what it ends with); ``bounds``
give each rank's block of items in the buffer the rank order concatenates:

- **gather** to ``root`` (linear: the root receives every block directly, as MPI does for large blocks): rank r's
  ``src`` lands in ``dst[bounds[r]]`` at the root; the others have no ``dst``.
- **scatter** from ``root`` (linear): block ``bounds[r]`` of the root's ``src`` lands in rank r's ``dst``.
- **all-to-all** (pairwise: in step k rank r sends to ``r + k`` and receives from ``r - k``, so every link carries
  one message a step and no rank is a hot spot): ``send[r][q]`` is the block of r's ``src`` for rank q,
  ``recv[r][q]`` where q's block lands in r's ``dst``.
- **reduce** to ``root``: the binomial reduce of :func:`~.plans.binomial_tree_reduce` (ceil(log2 N) rounds); a
  mean is finished at the root (one division).

Each plan starts with the agreement (:func:`~.lower.agreement_into`, with the counts as its payload where receivers
need them) unless ``agreement=False``: the calls run the agreement on its own first (through shared memory where
enabled), then the rest of the plan.

Example:
    >>> blocks = ((0, 1), (1, 2), (2, 3))
    >>> plan = alltoall_plan(3, [blocks] * 3, [blocks] * 3, itemsize=8, agreement=False)
    >>> [(m.src, m.dst) for m in plan.messages()]
    [(0, 1), (0, 2), (1, 2), (1, 0), (2, 0), (2, 1)]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from paratrain.collectives.lower import agreement_into, tree_reduce_into, world_plan
from paratrain.collectives.plans import binomial_tree_reduce
from paratrain.plan.ir import Plan, PlanBuilder, Received, Slice

__all__ = ["alltoall_plan", "gather_plan", "reduce_to_plan", "scatter_plan"]

Bounds = tuple[tuple[int, int], ...]


def _agreement(b: PlanBuilder, rank: int, n: int, payload_items: int, agreement: bool) -> None:
    if agreement:
        agreement_into(b, rank, n, payload_items=payload_items, itemsize=8 if payload_items else 0)


@functools.lru_cache(maxsize=256)
def gather_plan(n: int, bounds: Bounds, itemsize: int, *, root: int = 0, agreement: bool = True) -> Plan:
    """Every rank's block to ``root``: ``src`` of rank r into ``dst[bounds[r]]`` there.

    Example:
        >>> [(m.src, m.dst, m.nbytes) for m in gather_plan(3, ((0, 2), (2, 3), (3, 3)), 4, agreement=False).messages()]
        [(1, 0, 4)]
    """

    def part(b: PlanBuilder, r: int) -> None:
        _agreement(b, r, n, 0, agreement)
        if r != root:
            a, z = bounds[r]
            if z > a:
                b.send(root, Slice("src", 0, z - a), itemsize=itemsize)
            return
        posted = {q: b.recv(q, items=z - a, itemsize=itemsize) for q, (a, z) in enumerate(bounds) if q != r and z > a}
        a, z = bounds[r]
        if z > a:
            b.copy(Slice("src", 0, z - a), Slice("dst", a, z), itemsize=itemsize)
        for q, handle in posted.items():
            b.copy(Received(handle), Slice("dst", *bounds[q]), itemsize=itemsize)

    return world_plan(f"gather/linear:{root}", n, part)


@functools.lru_cache(maxsize=256)
def scatter_plan(n: int, bounds: Bounds, itemsize: int, *, root: int = 0, agreement: bool = True) -> Plan:
    """Block ``bounds[r]`` of ``root``'s ``src`` to rank r's ``dst``; the agreement carries the counts (one item of
    8 bytes per rank: the calls send the root's split to everyone, so that non-roots learn their block's size).

    Example:
        >>> [(m.src, m.dst, m.nbytes) for m in scatter_plan(2, ((0, 1), (1, 3)), 8, root=1, agreement=False).messages()]
        [(1, 0, 8)]
    """

    def part(b: PlanBuilder, r: int) -> None:
        _agreement(b, r, n, n, agreement)
        if r != root:
            a, z = bounds[r]
            if z > a:
                b.copy(
                    Received(b.recv(root, items=z - a, itemsize=itemsize)), Slice("dst", 0, z - a), itemsize=itemsize
                )
            return
        for q, (a, z) in enumerate(bounds):
            if q != r and z > a:
                b.send(q, Slice("src", a, z), itemsize=itemsize)
        a, z = bounds[r]
        if z > a:
            b.copy(Slice("src", a, z), Slice("dst", 0, z - a), itemsize=itemsize)

    return world_plan(f"scatter/linear:{root}", n, part)


def alltoall_plan(
    n: int, send: Sequence[Bounds], recv: Sequence[Bounds], *, itemsize: int, agreement: bool = True
) -> Plan:
    """Pairwise all-to-all: ``send[r][q]`` of rank r's ``src`` to ``recv[q][r]`` of rank q's ``dst``. Every
    receive is posted first, then step k (1..N-1) sends to ``r + k``; the own block is copied last. The
    agreement carries each rank's counts (N items of 8 bytes), which is how a receiver learns uneven blocks.

    Raises:
        ValueError: a block sent and the block it lands in differ in size.
    """
    for r in range(n):
        for q in range(n):
            if send[r][q][1] - send[r][q][0] != recv[q][r][1] - recv[q][r][0]:
                raise ValueError(f"rank {r} sends {send[r][q]} to rank {q}, which expects {recv[q][r]}")
    return _alltoall_plan(n, tuple(tuple(s) for s in send), tuple(tuple(s) for s in recv), itemsize, agreement)


@functools.lru_cache(maxsize=256)
def _alltoall_plan(n: int, send: tuple[Bounds, ...], recv: tuple[Bounds, ...], itemsize: int, agreement: bool) -> Plan:
    def part(b: PlanBuilder, r: int) -> None:
        _agreement(b, r, n, n, agreement)
        order = [(r - k) % n for k in range(1, n)]
        posted = {
            q: b.recv(q, items=recv[r][q][1] - recv[r][q][0], itemsize=itemsize) for q in order if _size(recv[r][q])
        }
        for k in range(1, n):
            q = (r + k) % n
            if _size(send[r][q]):
                b.send(q, Slice("src", *send[r][q]), itemsize=itemsize)
        if _size(send[r][r]):
            b.copy(Slice("src", *send[r][r]), Slice("dst", *recv[r][r]), itemsize=itemsize)
        for q in order:
            if q in posted:
                b.copy(Received(posted[q]), Slice("dst", *recv[r][q]), itemsize=itemsize)

    return world_plan("alltoall/pairwise", n, part)


def _size(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


@functools.lru_cache(maxsize=256)
def reduce_to_plan(n: int, count: int, itemsize: int, *, root: int = 0, agreement: bool = True) -> Plan:
    """The binomial reduce of ``count`` items to ``root`` (``dst`` there), finished there (a mean divided: the
    reducer's ``finish``, nothing for the other ops).

    Example:
        >>> [(m.src, m.dst) for m in reduce_to_plan(4, 2, 8, root=3, agreement=False).messages()]
        [(0, 3), (1, 3), (2, 1)]
    """

    def part(b: PlanBuilder, r: int) -> None:
        _agreement(b, r, n, 0, agreement)
        tree_reduce_into(b, binomial_tree_reduce(r, n, root), count, itemsize=itemsize, is_root=r == root)
        if r == root:
            b.finish(Slice("dst", 0, count), n, itemsize=itemsize)

    return world_plan(f"reduce/tree:{root}", n, part)
