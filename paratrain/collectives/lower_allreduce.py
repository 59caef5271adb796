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
import itertools
from collections.abc import Sequence

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
from paratrain.collectives.plans_allreduce import TreePlace, double_binary_tree, halving_doubling, torus_shape
from paratrain.collectives.plans_blink import PackedTree, orient
from paratrain.plan.ir import Plan, PlanBuilder, Received, Slice

__all__ = [
    "PLANNED_ALGORITHMS",
    "allreduce_parts",
    "allreduce_plan",
    "double_tree_into",
    "halving_doubling_into",
    "rate_bounds",
    "torus_into",
    "trees_into",
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
    """The double binary tree (:func:`~.plans_allreduce.double_binary_tree`): half k of the array up and down
    tree k (:func:`trees_into`). Sum order: this rank's part + its first child's subtree + its second's."""
    places = [double_binary_tree(r, n) for r in range(n)]
    trees = [[place[t] for place in places] for t in range(2)]
    trees_into(b, rank, trees, chunk_bounds(count, 2), itemsize=itemsize, segment=segment)


def rate_bounds(count: int, rates: Sequence[float]) -> list[tuple[int, int]]:
    """``[0, count)`` cut into one part per rate, each as long as its share of the total (rounded).

    Example:
        >>> rate_bounds(10, [3.0, 1.0, 1.0])
        [(0, 6), (6, 8), (8, 10)]
    """
    total = sum(rates)
    cuts = [0]
    acc = 0.0
    for rate in rates[:-1]:
        acc += rate
        cuts.append(max(cuts[-1], min(count, round(count * acc / total))))
    cuts.append(count)
    return list(itertools.pairwise(cuts))


_Item = tuple[int, str]  # (tree, "up" or "down")


def trees_into(
    b: PlanBuilder,
    rank: int,
    trees: Sequence[Sequence[TreePlace]],
    parts: Sequence[tuple[int, int]],
    *,
    itemsize: int,
    segment: int,
) -> None:
    """Allreduce over several spanning trees at once: part k of the array (items ``parts[k]``) is reduced up tree
    k (``trees[k][r]``: rank r's place in it) to its root, which finishes it, and broadcast down it, segment by
    segment; a segment goes down ``L = bit_length(n)`` segments after it went up, so that the two directions of
    every link work at once.

    Each rank issues a round's items (tree, direction) in its own order: what does not wait first (up: the trees
    it is a leaf of; down: those it is the root of), then the rest in tree order. Every wait is then on a child
    (up) or the parent (down), and two waiting items are in tree order on every rank: no cycle of waits. A
    round's receives are all posted first, from each peer in the order that peer sends (messages between two
    ranks match in order). Sum order at each node: its own part + its first child's subtree + its second's..."""
    n = len(trees[0]) if trees else 1
    segs = [segment_bounds(a, z, segment) for a, z in parts]
    lag = n.bit_length()

    def order(r: int) -> list[_Item]:
        ups = sorted(range(len(trees)), key=lambda t: (bool(trees[t][r].children), t))
        downs = sorted(range(len(trees)), key=lambda t: (trees[t][r].parent is not None, t))
        return [(t, "up") for t in ups] + [(t, "down") for t in downs]

    def destinations(r: int, item: _Item) -> tuple[int, ...]:
        place = trees[item[0]][r]
        if item[1] == "down":
            return place.children
        return () if place.parent is None else (place.parent,)

    mine = order(rank)
    peers = sorted(
        {q for t in range(len(trees)) for q in trees[t][rank].children}
        | {q for t in range(len(trees)) if (q := trees[t][rank].parent) is not None}
    )
    incoming = {q: [item for item in order(q) if rank in destinations(q, item)] for q in peers}

    for k in range(max((len(s) for s in segs), default=0) + lag):

        def segment_of(item: _Item, k: int = k) -> tuple[int, int] | None:
            at = k if item[1] == "up" else k - lag
            return segs[item[0]][at] if 0 <= at < len(segs[item[0]]) else None

        posted: dict[tuple[int, str, int], int] = {}
        for q, items in incoming.items():
            for item in items:
                seg = segment_of(item)
                if seg is not None:
                    posted[(*item, q)] = b.recv(q, items=seg[1] - seg[0], itemsize=itemsize)
        for item in mine:
            seg = segment_of(item)
            if seg is None:
                continue
            t, a, z = item[0], *seg
            place = trees[t][rank]
            if item[1] == "up":
                acc, dst = Slice("src", a, z), Slice("dst", a, z)
                for c in place.children:
                    b.reduce(acc, Received(posted[(t, "up", c)]), dst, itemsize=itemsize)
                    acc = dst
                if place.parent is not None:
                    b.send(place.parent, acc, itemsize=itemsize)
                    continue
                if acc != dst and not b.aliased:
                    b.copy(acc, dst, itemsize=itemsize)
                b.finish(dst, n, itemsize=itemsize)
            elif place.parent is None:
                for c in place.children:
                    b.send(c, Slice("dst", a, z), itemsize=itemsize)
            else:
                got = posted[(t, "down", place.parent)]
                for c in place.children:
                    b.send(c, Received(got), items=z - a, itemsize=itemsize)
                b.copy(Received(got), Slice("dst", a, z), itemsize=itemsize)


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
    trees: tuple[PackedTree, ...] | None = None,
    agreement: bool = True,
) -> PlanParts:
    """One allreduce call of ``count`` items per rank, a rank at a time (see :class:`~.lower.PlanParts`): the
    agreement (unless ``agreement`` is False; ``"direct"`` carries its data in it, ``"shm"`` folds it into its
    first synchronisation), then the algorithm: one of :data:`PLANNED_ALGORITHMS`, ``"hierarchical"`` with
    ``hosts``, ``"shm"`` with ``shm=(block_items, align, small_bytes)`` of the group, ``"blink"`` with
    ``trees`` (:func:`~.plans_blink.pack_trees`: each tree its share of the array, by its rate).

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
    elif algorithm == "blink":
        if not trees:
            raise ValueError("the tree-packing allreduce plan needs trees= (plans_blink.pack_trees of the links)")
        places = [orient(tree, n) for tree in trees]
        parts = rate_bounds(count, [tree.rate for tree in trees])

        def body(b: PlanBuilder, r: int) -> None:
            trees_into(b, r, places, parts, itemsize=itemsize, segment=segment)

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
    trees: tuple[PackedTree, ...] | None = None,
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
        trees=trees,
        agreement=agreement,
    ).plan()
