"""The collectives' step tables (:mod:`.plans`) lowered to the plan IR: sizes, segments, buffers, dependencies.

:mod:`.plans` says *who talks to whom in which step*; this module turns one call (its item count, item size,
pipelining segment, root, in-place or not) into the exact actions a rank executes (:mod:`paratrain.plan.ir`).
The executors (:mod:`.execute`, :func:`.tree.agree`, :func:`.barrier.barrier`) iterate these actions and
nothing else, the cost model replays them, and a recording transport checks that a run sent exactly them.

Every ``*_into`` function appends one rank's part of one schedule to a :class:`~paratrain.plan.ir.PlanBuilder`
in the numbering of the group it runs on (``builder.members`` maps it to the plan's ranks), so schedules
compose: the hierarchical allreduce is a tree reduce, a ring and a tree broadcast appended to one builder.
The ``*_plan`` functions build the whole world's plan, cached: a call's plan depends only on its sizes, and
the executors run their rank's part of that very object. The cache matters: building a plan costs tens of
microseconds, a tenth of a small tree allreduce (64 KiB over ZeroMQ, 2 ranks, median of 4 interleaved runs:
0.59 ms before the plan IR, 0.70 ms with plans built per call, 0.58 ms cached).

Buffers: ``"src"`` (what this rank contributes; the root's data in a broadcast), ``"dst"`` (the result),
``"gathered"`` (the agreement's payloads, ``index`` = rank) and ``"own"`` (a private copy of ``src``).

Every schedule here lowers into the same builder with the same slice and dependency rules, and the plans compose
each other (the agreement opens every call, the hierarchical plan nests the ring and the chains). The allreduce
schedules built on these (halving-doubling, the 2-D torus, the double binary tree) and the allreduce call's plan
are in :mod:`.lower_allreduce`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from paratrain.collectives.plans import (
    RingStep,
    TreeStep,
    binomial_tree_broadcast,
    binomial_tree_reduce,
    chain_broadcast,
    chunk_bounds,
    dissemination_barrier,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)
from paratrain.plan.ir import Action, Plan, PlanBuilder, Received, Slice

__all__ = [
    "SEGMENT_BYTES",
    "PlanParts",
    "agreement_into",
    "agreement_plan",
    "allgather_parts",
    "allgather_plan",
    "barrier_into",
    "barrier_plan",
    "broadcast_plan",
    "chain_broadcast_into",
    "direct_allreduce_into",
    "hierarchical_allreduce_into",
    "reduce_plan",
    "reduce_scatter_parts",
    "reduce_scatter_plan",
    "ring_into",
    "segment_bounds",
    "segment_items",
    "tree_allreduce_into",
    "tree_broadcast_into",
    "tree_reduce_into",
    "with_agreement",
    "world_plan",
]

#: Pipelining unit of the ring and chain schedules, in bytes. Smaller segments start the pipeline sooner and
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


def segment_items(itemsize: int, segment_bytes: int | None) -> int:
    """Items per pipelining segment for items of ``itemsize`` bytes (at least 1)."""
    return max(1, (SEGMENT_BYTES if segment_bytes is None else segment_bytes) // max(itemsize, 1))


# -- ring -------------------------------------------------------------------------------------------------------


def ring_into(
    b: PlanBuilder,
    steps: Sequence[RingStep],
    bounds: Sequence[tuple[int, int]],
    *,
    itemsize: int,
    segment: int,
    reduce_steps: int,
    divide_by: int,
    src: str = "src",
) -> None:
    """A ring pass whose every step sends the chunk received in the step before, segment by segment.

    Step 0 sends chunk ``steps[0].send_chunk`` from ``src``. In steps ``< reduce_steps`` each received segment
    is combined with ``src`` into ``dst`` and the result forwarded (the last of them also finishes a mean over
    ``divide_by``); later steps forward the received frame itself (the copy into ``dst`` leaves the critical
    path). So while segment k is reduced, k - 1 travels to the right and k + 1 arrives from the left::

        time ->     seg 0         seg 1         seg 2
        recv    |===========|===========|===========|
        reduce              |====|      |====|      |====|
        send                     |===========|===========|===========|
    """
    if not steps:
        return
    segs = [segment_bounds(a, z, segment) for a, z in bounds]
    first = steps[0]
    for a, z in segs[first.send_chunk]:
        b.send(first.send_to, Slice(src, a, z), itemsize=itemsize)
    for s, step in enumerate(steps):
        chunk = step.recv_chunk
        posted = [b.recv(step.recv_from, items=z - a, itemsize=itemsize) for a, z in segs[chunk]]
        forward_to = steps[s + 1].send_to if s + 1 < len(steps) else None
        for (a, z), handle in zip(segs[chunk], posted, strict=True):
            out = Slice("dst", a, z)
            if s < reduce_steps:
                b.reduce(Slice(src, a, z), Received(handle), out, itemsize=itemsize)
                if s == reduce_steps - 1:
                    b.finish(out, divide_by, itemsize=itemsize)
                if forward_to is not None:
                    b.send(forward_to, out, itemsize=itemsize)
            else:
                if forward_to is not None:
                    b.send(forward_to, Received(handle), items=z - a, itemsize=itemsize)
                b.copy(Received(handle), out, itemsize=itemsize)


# -- trees and chains -------------------------------------------------------------------------------------------


def tree_reduce_into(b: PlanBuilder, steps: Sequence[TreeStep], count: int, *, itemsize: int, is_root: bool) -> None:
    """A binomial reduce (``steps`` from :func:`~.plans.binomial_tree_reduce`): children's partial results are
    combined in plan order into ``dst``, which then goes to the parent. A mean is not finished here."""
    posted = {s.peer: b.recv(s.peer, items=count, itemsize=itemsize) for s in steps if s.direction == "recv"}
    acc = Slice("src", 0, count)
    dst = Slice("dst", 0, count)
    for step in steps:
        if step.direction == "recv":
            b.reduce(acc, Received(posted[step.peer]), dst, itemsize=itemsize)
            acc = dst
        else:
            b.send(step.peer, acc, itemsize=itemsize)
    if is_root and acc != dst and not b.aliased:
        b.copy(acc, dst, itemsize=itemsize)


def tree_broadcast_into(
    b: PlanBuilder, steps: Sequence[TreeStep], count: int, *, itemsize: int, source: str | None
) -> None:
    """A broadcast along ``steps`` (a tree or a chain without segments): the root sends ``source``; the others
    receive, forward the received frame to their children, then copy it into ``dst``."""
    data: Slice | Received | None = None if source is None else Slice(source, 0, count)
    for step in steps:
        if step.direction == "recv":
            data = Received(b.recv(step.peer, items=count, itemsize=itemsize))
        else:
            assert data is not None, "a broadcast plan receives before it sends"
            b.send(step.peer, data, items=count, itemsize=itemsize)
    dst = Slice("dst", 0, count)
    if data is not None and data != dst and not (b.aliased and isinstance(data, Slice)):
        b.copy(data, dst, itemsize=itemsize)


def chain_broadcast_into(
    b: PlanBuilder, steps: Sequence[TreeStep], count: int, *, itemsize: int, segment: int, is_root: bool
) -> None:
    """A pipelined chain broadcast: each segment is forwarded as soon as it arrives, then copied into ``dst``."""
    recv_from = next((s.peer for s in steps if s.direction == "recv"), None)
    send_to = next((s.peer for s in steps if s.direction == "send"), None)
    segs = segment_bounds(0, count, segment)
    if is_root:
        for a, z in segs:
            if send_to is not None:
                b.send(send_to, Slice("src", a, z), itemsize=itemsize)
        if not b.aliased:
            b.copy(Slice("src", 0, count), Slice("dst", 0, count), itemsize=itemsize)
        return
    assert recv_from is not None
    posted = [b.recv(recv_from, items=z - a, itemsize=itemsize) for a, z in segs]
    for (a, z), handle in zip(segs, posted, strict=True):
        if send_to is not None:
            b.send(send_to, Received(handle), items=z - a, itemsize=itemsize)
        b.copy(Received(handle), Slice("dst", a, z), itemsize=itemsize)


def tree_allreduce_into(b: PlanBuilder, rank: int, n: int, count: int, *, itemsize: int) -> None:
    """Binomial reduce to rank 0, finish the mean there, binomial broadcast of the result."""
    tree_reduce_into(b, binomial_tree_reduce(rank, n, 0), count, itemsize=itemsize, is_root=rank == 0)
    if rank == 0:
        b.finish(Slice("dst", 0, count), n, itemsize=itemsize)
    steps = binomial_tree_broadcast(rank, n, 0)
    tree_broadcast_into(b, steps, count, itemsize=itemsize, source="dst" if rank == 0 else None)


def hierarchical_allreduce_into(
    b: PlanBuilder, rank: int, hosts: Sequence[str], count: int, *, itemsize: int, segment: int
) -> None:
    """Reduce inside each host to its leader (its lowest rank), ring allreduce over the leaders, broadcast
    inside each host; ``b.members`` must be the identity (the phases set it to the host's or leaders' ranks)."""
    local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    leaders = sorted({min(r for r, h in enumerate(hosts) if h == host) for host in hosts})
    me = local.index(rank)
    b.members = local
    tree_reduce_into(b, binomial_tree_reduce(me, len(local), 0), count, itemsize=itemsize, is_root=me == 0)
    if me == 0:
        if len(leaders) > 1:
            b.members = leaders
            i = leaders.index(rank)
            steps = ring_allreduce(i, len(leaders))
            bounds = chunk_bounds(count, len(leaders))
            ring_into(
                b,
                steps,
                bounds,
                itemsize=itemsize,
                segment=segment,
                reduce_steps=len(leaders) - 1,
                divide_by=1,
                src="dst",
            )
        b.finish(Slice("dst", 0, count), len(hosts), itemsize=itemsize)
    b.members = local
    steps_b = binomial_tree_broadcast(me, len(local), 0)
    tree_broadcast_into(b, steps_b, count, itemsize=itemsize, source="dst" if me == 0 else None)
    b.members = None


# -- the agreement, direct allreduce, barrier --------------------------------------------------------------------


def agreement_into(b: PlanBuilder, rank: int, n: int, *, payload_items: int = 0, itemsize: int = 0) -> None:
    """The agreement's dissemination allgather (Bruck): round k sends what this rank knows of ranks ``r, r - 1,
    ...`` (``min(2**k, n - 2**k)`` of them) to ``r + 2**k`` and receives as many from ``r - 2**k``; a round's send
    waits for the previous round's message (it forwards what that brought). With a payload (``"direct"``) every
    message also carries that many ranks' arrays of ``payload_items`` items; the signatures travel in the
    header, which the plan does not count."""
    previous: int | None = None
    first = len(b)
    for k, rnd in enumerate(dissemination_barrier(rank, n)):
        count = min(1 << k, n - (1 << k))
        handle = b.message("recv", rnd.recv_from, nbytes=count * payload_items * itemsize, items=count * payload_items)
        data = Slice("src", 0, payload_items) if payload_items else None
        b.message(
            "send",
            rnd.send_to,
            nbytes=count * payload_items * itemsize,
            items=count * payload_items,
            data=data,
            deps=() if previous is None else (previous,),
        )
        previous = handle
    # agree() returns once every round arrived: what follows starts then
    b.fence(i for i, a in enumerate(b.actions) if i >= first and a.kind == "recv")


def direct_allreduce_into(b: PlanBuilder, rank: int, n: int, count: int, *, itemsize: int) -> None:
    """The agreement with every rank's array as payload, then every rank reduces all N in rank order."""
    agreement_into(b, rank, n, payload_items=count, itemsize=itemsize)
    blocks = [Slice("gathered", 0, count, index=q) for q in range(n)]
    if b.aliased and rank >= 2:  # dst (= src) is overwritten before our own turn comes
        blocks[rank] = Slice("own", 0, count)
        b.copy(Slice("src", 0, count), blocks[rank], itemsize=itemsize)
    dst = Slice("dst", 0, count)
    b.reduce(blocks[0], blocks[1], dst, itemsize=itemsize)  # after the agreement's fence: all payloads are in
    for block in blocks[2:]:
        b.reduce(dst, block, dst, itemsize=itemsize)
    b.finish(dst, n, itemsize=itemsize)


def barrier_into(b: PlanBuilder, rank: int, n: int) -> None:
    """The dissemination barrier: round k signals ``r + 2**k`` and waits for ``r - 2**k`` before round k + 1."""
    previous: int | None = None
    for rnd in dissemination_barrier(rank, n):
        b.message("send", rnd.send_to, nbytes=0, deps=() if previous is None else (previous,))
        previous = b.message("recv", rnd.recv_from, nbytes=0)


# -- whole plans ------------------------------------------------------------------------------------------------

RankPart = Callable[[PlanBuilder, int], None]


def world_plan(name: str, n: int, part: RankPart, *, aliased: bool = False) -> Plan:
    """The plan whose rank r's actions are what ``part(builder, r)`` appends to a fresh builder.

    Example:
        >>> world_plan("barrier", 3, lambda b, r: barrier_into(b, r, 3)).messages()[:2]
        [Message(src=0, dst=1, tag=0, nbytes=0), Message(src=0, dst=2, tag=0, nbytes=0)]
    """
    ranks: list[tuple[Action, ...]] = []
    for rank in range(n):
        b = PlanBuilder(aliased=aliased)
        part(b, rank)
        ranks.append(b.actions)
    return Plan(name, tuple(ranks))


@dataclasses.dataclass(frozen=True)
class PlanParts:
    """A plan described rank by rank and built on demand: ``rank(r)`` costs only rank r's actions.

    A ring over N ranks has O(N) actions per rank and O(N^2) in all; the simulator replays a symmetric plan from
    one rank's actions (:func:`paratrain.sim.replay.replay_symmetric`), so at 1024 ranks it never builds the rest.
    """

    name: str
    n: int
    part: RankPart
    aliased: bool = False

    def rank(self, r: int) -> tuple[Action, ...]:
        """Rank ``r``'s actions."""
        b = PlanBuilder(aliased=self.aliased)
        self.part(b, r)
        return b.actions

    def plan(self) -> Plan:
        """Every rank's actions."""
        return world_plan(self.name, self.n, self.part, aliased=self.aliased)


def with_agreement(agreement: bool, n: int, body: RankPart) -> RankPart:
    """``body`` opened by the agreement (unless ``agreement`` is False): what every call's plan is."""

    def part(b: PlanBuilder, rank: int) -> None:
        if agreement:
            agreement_into(b, rank, n)
        body(b, rank)

    return part


@functools.lru_cache(maxsize=256)
def broadcast_plan(
    algorithm: str,
    n: int,
    count: int,
    itemsize: int,
    *,
    root: int = 0,
    segment_bytes: int | None = None,
    aliased: bool = False,
    agreement: bool = True,
) -> Plan:
    """The plan of one broadcast call (``"tree"`` or ``"chain"``) of ``count`` items from ``root``; ``aliased``:
    the root's source is its destination (nothing to copy there)."""
    segment = segment_items(itemsize, segment_bytes)

    def body(b: PlanBuilder, r: int) -> None:
        if algorithm == "tree":
            steps = binomial_tree_broadcast(r, n, root)
            tree_broadcast_into(b, steps, count, itemsize=itemsize, source="src" if r == root else None)
        elif algorithm == "chain":
            steps = chain_broadcast(r, n, root)
            chain_broadcast_into(b, steps, count, itemsize=itemsize, segment=segment, is_root=r == root)
        else:
            raise ValueError(f"no plan for broadcast algorithm {algorithm!r}")

    return world_plan(f"broadcast/{algorithm}", n, with_agreement(agreement, n, body), aliased=aliased)


@functools.lru_cache(maxsize=256)
def reduce_plan(n: int, count: int, itemsize: int, *, aliased: bool = False) -> Plan:
    """A binomial reduce of ``count`` items to rank 0 (a mean is not finished: the caller divides once)."""

    def body(b: PlanBuilder, r: int) -> None:
        tree_reduce_into(b, binomial_tree_reduce(r, n, 0), count, itemsize=itemsize, is_root=r == 0)

    return world_plan("reduce/tree", n, body, aliased=aliased)


@functools.lru_cache(maxsize=256)
def agreement_plan(n: int, payload_items: int = 0, itemsize: int = 0) -> Plan:
    """The agreement alone (:func:`agreement_into`), with an optional payload of ``payload_items`` per rank."""
    return world_plan(
        "agreement", n, lambda b, r: agreement_into(b, r, n, payload_items=payload_items, itemsize=itemsize)
    )


@functools.lru_cache(maxsize=256)
def reduce_scatter_plan(
    n: int,
    bounds: tuple[tuple[int, int], ...],
    itemsize: int,
    *,
    segment_bytes: int | None = None,
    aliased: bool = False,
    agreement: bool = True,
) -> Plan:
    """The plan of one ring reduce-scatter over the flat chunks ``bounds`` (rank r keeps chunk r)."""
    return reduce_scatter_parts(
        n, bounds, itemsize, segment_bytes=segment_bytes, aliased=aliased, agreement=agreement
    ).plan()


def reduce_scatter_parts(
    n: int,
    bounds: tuple[tuple[int, int], ...],
    itemsize: int,
    *,
    segment_bytes: int | None = None,
    aliased: bool = False,
    agreement: bool = True,
) -> PlanParts:
    """:func:`reduce_scatter_plan` a rank at a time (see :class:`PlanParts`)."""
    return _ring_parts("reduce_scatter", n, bounds, itemsize, segment_bytes, aliased=aliased, agreement=agreement)


@functools.lru_cache(maxsize=256)
def allgather_plan(
    n: int,
    bounds: tuple[tuple[int, int], ...],
    itemsize: int,
    *,
    segment_bytes: int | None = None,
    agreement: bool = True,
) -> Plan:
    """The plan of one ring allgather in place: rank r's block is ``bounds[r]`` of ``dst``."""
    return allgather_parts(n, bounds, itemsize, segment_bytes=segment_bytes, agreement=agreement).plan()


def allgather_parts(
    n: int,
    bounds: tuple[tuple[int, int], ...],
    itemsize: int,
    *,
    segment_bytes: int | None = None,
    agreement: bool = True,
) -> PlanParts:
    """:func:`allgather_plan` a rank at a time (see :class:`PlanParts`)."""
    return _ring_parts("allgather", n, bounds, itemsize, segment_bytes, aliased=True, agreement=agreement)


def _ring_parts(
    kind: str,
    n: int,
    bounds: tuple[tuple[int, int], ...],
    itemsize: int,
    segment_bytes: int | None,
    *,
    aliased: bool,
    agreement: bool,
) -> PlanParts:
    segment = segment_items(itemsize, segment_bytes)
    gather = kind == "allgather"

    def body(b: PlanBuilder, r: int) -> None:
        steps = ring_allgather(r, n) if gather else ring_reduce_scatter(r, n)
        ring_into(
            b,
            steps,
            bounds,
            itemsize=itemsize,
            segment=segment,
            reduce_steps=0 if gather else n - 1,
            divide_by=n,
            src="dst" if gather else "src",
        )

    return PlanParts(f"{kind}/ring", n, with_agreement(agreement, n, body), aliased=aliased)


@functools.lru_cache(maxsize=64)
def barrier_plan(n: int) -> Plan:
    """The dissemination barrier of ``n`` ranks."""
    return world_plan("barrier", n, lambda b, r: barrier_into(b, r, n))
