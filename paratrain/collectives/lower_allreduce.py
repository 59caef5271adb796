"""The allreduce call's plan, and the schedules lowered here: halving-doubling, the 2-D torus, the double tree.

:func:`allreduce_parts` turns one call (algorithm, ranks, items, item size) into every rank's actions: the
agreement, then the algorithm's schedule, from :mod:`.lower` (ring, tree, direct, hierarchical), :mod:`.lower_shm`
or below. The step tables of the three below are in :mod:`.plans_allreduce`; every message is cut into
pipelining segments as the ring's are (:data:`~.lower.SEGMENT_BYTES`), so a reduction overlaps the next
segment's arrival. Each element of the result is reduced once, by one rank, and copied to the others, so every
rank ends with the same bits; the order of the sum (what float results depend on) is said per schedule.
"""

from __future__ import annotations

import functools

from paratrain.collectives.lower import (
    PlanParts,
    RankPart,
    direct_allreduce_into,
    hierarchical_allreduce_into,
    ring_into,
    segment_bounds,
    segment_items,
    tree_allreduce_into,
    with_agreement,
)
from paratrain.collectives.lower_shm import shm_allreduce_into
from paratrain.collectives.plans import chunk_bounds, ring_allgather, ring_allreduce, ring_reduce_scatter
from paratrain.collectives.plans_allreduce import BinaryTree, double_binary_tree, halving_doubling, torus_shape
from paratrain.plan.ir import Plan, PlanBuilder, Received, Slice

__all__ = [
    "PLANNED_ALGORITHMS",
    "allreduce_parts",
    "allreduce_plan",
    "double_tree_into",
    "halving_doubling_into",
    "torus_into",
]

#: The allreduce algorithms with a plan over sockets, whatever the hosts (``"hierarchical"`` and ``"shm"`` need
#: a layout), simplest first: the order the cost-model policy breaks ties in.
PLANNED_ALGORITHMS = ("direct", "tree", "ring", "halving_doubling", "torus", "double_tree")


def _exchange(
    b: PlanBuilder, peer: int, send: Slice | None, recv: tuple[int, int], *, itemsize: int, segment: int
) -> list[tuple[int, int, int]]:
    """Sends ``send`` to ``peer`` and posts the receives of items ``recv`` from it, segment by segment; returns
    ``(start, stop, receive)`` per received segment."""
    if send is not None:
        for a, z in segment_bounds(send.start, send.stop, segment):
            b.send(peer, Slice(send.buffer, a, z), itemsize=itemsize)
    return [(a, z, b.recv(peer, items=z - a, itemsize=itemsize)) for a, z in segment_bounds(*recv, segment)]


def halving_doubling_into(b: PlanBuilder, rank: int, n: int, count: int, *, itemsize: int, segment: int) -> None:
    """Recursive halving-doubling (:func:`~.plans_allreduce.halving_doubling`). Sum order: a folded pair first
    (odd rank's array + even rank's), then at each halving step what this rank holds + what its partner sent."""
    h = halving_doubling(rank, n)
    bounds = chunk_bounds(count, h.parts)

    def items(parts: tuple[int, int]) -> tuple[int, int]:
        return bounds[parts[0]][0], bounds[parts[1] - 1][1]

    if h.fold is not None and h.fold[0] == "send":  # sits out: hands its array over, gets the result back
        peer = h.fold[1]
        _exchange(b, peer, Slice("src", 0, count), (0, 0), itemsize=itemsize, segment=segment)
        for a, z, got in _exchange(b, peer, None, (0, count), itemsize=itemsize, segment=segment):
            b.copy(Received(got), Slice("dst", a, z), itemsize=itemsize)
        return
    acc = "src"
    if h.fold is not None:
        for a, z, got in _exchange(b, h.fold[1], None, (0, count), itemsize=itemsize, segment=segment):
            b.reduce(Slice("src", a, z), Received(got), Slice("dst", a, z), itemsize=itemsize)
        acc = "dst"
    for step in h.halving:
        sent = Slice(acc, *items(step.send))
        for a, z, got in _exchange(b, step.peer, sent, items(step.recv), itemsize=itemsize, segment=segment):
            b.reduce(Slice(acc, a, z), Received(got), Slice("dst", a, z), itemsize=itemsize)
        acc = "dst"
    own = items(h.halving[-1].recv) if h.halving else (0, count)
    if acc == "src" and not b.aliased:  # one rank: nothing was reduced into dst
        b.copy(Slice("src", 0, count), Slice("dst", 0, count), itemsize=itemsize)
    if own[1] > own[0]:
        b.finish(Slice("dst", *own), n, itemsize=itemsize)
    for step in h.doubling:
        held = Slice("dst", *items(step.send))
        for a, z, got in _exchange(b, step.peer, held, items(step.recv), itemsize=itemsize, segment=segment):
            b.copy(Received(got), Slice("dst", a, z), itemsize=itemsize)
    if h.fold is not None:  # gives the rank that sat out its result
        _exchange(b, h.fold[1], Slice("dst", 0, count), (0, 0), itemsize=itemsize, segment=segment)


def torus_into(b: PlanBuilder, rank: int, n: int, count: int, *, itemsize: int, segment: int) -> None:
    """The 2-D torus (:func:`~.plans_allreduce.torus_shape`): ring reduce-scatter along the row, ring allreduce
    of the part held along the column, ring allgather along the row; ``b.members`` must be the identity. Sum
    order: along the row in ring order, then the column's partial sums in ring order. One row (a prime N): the
    ring."""
    rows, cols = torus_shape(n)
    if rows == 1:
        ring_into(
            b, ring_allreduce(rank, n), chunk_bounds(count, n), itemsize=itemsize, segment=segment,
            reduce_steps=n - 1, divide_by=n,
        )  # fmt: skip
        return
    i, j = divmod(rank, cols)
    row = [i * cols + c for c in range(cols)]
    bounds = chunk_bounds(count, cols)
    b.members = row
    ring_into(
        b, ring_reduce_scatter(j, cols), bounds, itemsize=itemsize, segment=segment, reduce_steps=cols - 1,
        divide_by=1,
    )  # fmt: skip
    a, z = bounds[j]
    b.members = [r * cols + j for r in range(rows)]
    column_parts = [(a + x, a + y) for x, y in chunk_bounds(z - a, rows)]
    ring_into(
        b, ring_allreduce(i, rows), column_parts, itemsize=itemsize, segment=segment, reduce_steps=rows - 1,
        divide_by=n, src="dst",
    )  # fmt: skip
    b.members = row
    ring_into(
        b, ring_allgather(j, cols), bounds, itemsize=itemsize, segment=segment, reduce_steps=0, divide_by=n,
        src="dst",
    )  # fmt: skip
    b.members = None


def double_tree_into(b: PlanBuilder, rank: int, n: int, count: int, *, itemsize: int, segment: int) -> None:
    """The double binary tree (:func:`~.plans_allreduce.double_binary_tree`): half k of the array is reduced up
    tree k and broadcast down it, segment by segment; a segment goes down ``L = bit_length(n)`` segments after
    it went up, so that the two directions of every link work at once. Every rank issues the same sequence of
    (tree, segment, direction), each waiting only on its children (up) or its parent (down): no cycle of waits.
    Sum order: this rank's part + its first child's subtree + its second child's."""
    trees = double_binary_tree(rank, n)
    segs = [segment_bounds(a, z, segment) for a, z in chunk_bounds(count, 2)]
    lag = n.bit_length()

    def up(tree: BinaryTree, a: int, z: int) -> None:
        posted = [b.recv(c, items=z - a, itemsize=itemsize) for c in tree.children]
        acc, dst = Slice("src", a, z), Slice("dst", a, z)
        for got in posted:
            b.reduce(acc, Received(got), dst, itemsize=itemsize)
            acc = dst
        if tree.parent is not None:
            b.send(tree.parent, acc, itemsize=itemsize)
            return
        if acc != dst and not b.aliased:
            b.copy(acc, dst, itemsize=itemsize)
        b.finish(dst, n, itemsize=itemsize)

    def down(tree: BinaryTree, a: int, z: int) -> None:
        if tree.parent is None:
            for c in tree.children:
                b.send(c, Slice("dst", a, z), itemsize=itemsize)
            return
        got = b.recv(tree.parent, items=z - a, itemsize=itemsize)
        for c in tree.children:
            b.send(c, Received(got), items=z - a, itemsize=itemsize)
        b.copy(Received(got), Slice("dst", a, z), itemsize=itemsize)

    # what does not wait first (up: the trees this rank is a leaf of; down: those it is the root of), then the
    # rest in tree order, the same on every rank
    up_order = sorted(range(2), key=lambda t: (bool(trees[t].children), t))
    down_order = sorted(range(2), key=lambda t: (trees[t].parent is not None, t))
    for k in range(max(len(s) for s in segs) + lag):
        for t in up_order:
            if k < len(segs[t]):
                up(trees[t], *segs[t][k])
        for t in down_order:
            if 0 <= k - lag < len(segs[t]):
                down(trees[t], *segs[t][k - lag])


def allreduce_parts(
    algorithm: str,
    n: int,
    count: int,
    itemsize: int,
    *,
    aliased: bool = False,
    segment_bytes: int | None = None,
    hosts: tuple[str, ...] | None = None,
    shm: tuple[int, int, int] | None = None,
    agreement: bool = True,
) -> PlanParts:
    """One allreduce call of ``count`` items per rank, a rank at a time (see :class:`~.lower.PlanParts`): the
    agreement (unless ``agreement`` is False; ``"direct"`` carries its data in it, ``"shm"`` folds it into its
    first synchronisation), then the algorithm: one of :data:`PLANNED_ALGORITHMS`, ``"hierarchical"`` with
    ``hosts``, ``"shm"`` with ``shm=(block_items, align, small_bytes)`` of the group.

    Example:
        >>> p = allreduce_parts("ring", 2, 4, 8, agreement=False).plan()
        >>> p.sends(0)
        [Message(src=0, dst=1, tag=0, nbytes=16), Message(src=0, dst=1, tag=0, nbytes=16)]
    """
    segment = segment_items(itemsize, segment_bytes)
    body: RankPart
    if algorithm == "ring":
        bounds = chunk_bounds(count, n)

        def body(b: PlanBuilder, r: int) -> None:
            ring_into(
                b, ring_allreduce(r, n), bounds, itemsize=itemsize, segment=segment, reduce_steps=n - 1, divide_by=n
            )

    elif algorithm == "tree":

        def body(b: PlanBuilder, r: int) -> None:
            tree_allreduce_into(b, r, n, count, itemsize=itemsize)

    elif algorithm == "direct":

        def body(b: PlanBuilder, r: int) -> None:
            direct_allreduce_into(b, r, n, count, itemsize=itemsize)

        agreement = False  # it is the agreement
    elif algorithm in ("halving_doubling", "torus", "double_tree"):
        into = {"halving_doubling": halving_doubling_into, "torus": torus_into, "double_tree": double_tree_into}

        def body(b: PlanBuilder, r: int) -> None:
            into[algorithm](b, r, n, count, itemsize=itemsize, segment=segment)

    elif algorithm == "shm":
        if shm is None:
            raise ValueError("the shared-memory allreduce plan needs shm=(block_items, align, small_bytes)")
        block_items, align, small_bytes = shm

        def body(b: PlanBuilder, r: int) -> None:
            shm_allreduce_into(
                b,
                r,
                n,
                count,
                itemsize=itemsize,
                block_items=block_items,
                align=align,
                one_phase=count * itemsize <= small_bytes,
            )

        agreement = False  # folded into the first block's synchronisation
    elif algorithm == "hierarchical":
        if hosts is None or len(hosts) != n:
            raise ValueError("the hierarchical allreduce plan needs every rank's host")
        layout = hosts

        def body(b: PlanBuilder, r: int) -> None:
            hierarchical_allreduce_into(b, r, layout, count, itemsize=itemsize, segment=segment)

    else:
        raise ValueError(f"no plan for allreduce algorithm {algorithm!r}")
    return PlanParts(f"allreduce/{algorithm}", n, with_agreement(agreement, n, body), aliased=aliased)


@functools.lru_cache(maxsize=256)
def allreduce_plan(
    algorithm: str,
    n: int,
    count: int,
    itemsize: int,
    *,
    aliased: bool = False,
    segment_bytes: int | None = None,
    hosts: tuple[str, ...] | None = None,
    shm: tuple[int, int, int] | None = None,
    agreement: bool = True,
) -> Plan:
    """The whole plan of one allreduce call (every rank's actions; see :func:`allreduce_parts`).

    Example:
        >>> allreduce_plan("ring", 2, 4, 8, agreement=False).sends(0)
        [Message(src=0, dst=1, tag=0, nbytes=16), Message(src=0, dst=1, tag=0, nbytes=16)]
    """
    return allreduce_parts(
        algorithm,
        n,
        count,
        itemsize,
        aliased=aliased,
        segment_bytes=segment_bytes,
        hosts=hosts,
        shm=shm,
        agreement=agreement,
    ).plan()
