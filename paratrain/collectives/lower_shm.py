"""The shared-memory allreduce lowered to the plan IR: copies through the ranks' slots, reductions, counters.

Nothing is sent: ranks of one host synchronise through counters in one segment (:mod:`paratrain.shm`), which the
IR writes as ``signal``/``wait`` actions. :func:`shm_part_bounds` is the split the executor
(:mod:`paratrain.collectives.shm`) uses itself; :func:`shm_allreduce_into` is its protocol, step by step, which a
test compares with the counters a run takes and the cost model replays.
"""

from __future__ import annotations

from paratrain.plan.ir import PlanBuilder, Slice

__all__ = ["shm_allreduce_into", "shm_part_bounds"]


# -- shared memory -----------------------------------------------------------------------------------------------


def shm_part_bounds(count: int, size: int, align: int) -> list[tuple[int, int]]:
    """The parts of a block of ``count`` items that ``size`` ranks reduce in shared memory: equal, each a
    multiple of ``align`` items (a cache line, so no two ranks write one line), the last ones possibly short
    or empty.

    Example:
        >>> shm_part_bounds(100, 3, 16)
        [(0, 48), (48, 96), (96, 100)]
    """
    per = -(-count // size)
    per = -(-per // align) * align
    return [(min(q * per, count), min((q + 1) * per, count)) for q in range(size)]


def shm_allreduce_into(
    b: PlanBuilder, rank: int, n: int, count: int, *, itemsize: int, block_items: int, align: int, one_phase: bool
) -> None:
    """The shared-memory allreduce (:mod:`paratrain.collectives.shm`): no message, only copies through the
    ranks' slots, reductions and counters. ``signal``/``wait`` values count from the call's start.

    One phase (small arrays): copy all in, signal 1, wait 1, every rank reduces all N slots in rank order.
    Blocks of ``block_items``: ``in(k)`` copies the parts others reduce and signals ``2k+1``; ``red(k)`` waits
    ``2k+1``, reduces its own part from the N - 1 peers' slots, publishes it and signals ``2k+2``; the next
    block is copied in before ``out(k)`` waits ``2k+2`` and copies the peers' parts of the result.
    """
    if one_phase:
        b.copy(Slice("src", 0, count), Slice("slots", 0, count, index=rank), itemsize=itemsize)
        b.signal(1)
        b.wait(1)
        slots = [Slice("slots", 0, count, index=q) for q in range(n)]
        dst = Slice("dst", 0, count)
        b.reduce(slots[0], slots[1], dst, itemsize=itemsize)
        for slot in slots[2:]:
            b.reduce(dst, slot, dst, itemsize=itemsize)
        b.finish(dst, n, itemsize=itemsize)
        return
    starts = list(range(0, count, block_items))

    def copy_in(k: int) -> None:
        start = starts[k]
        items = min(block_items, count - start)
        lo, hi = shm_part_bounds(items, n, align)[rank]
        for a, z in ((0, lo), (hi, items)):
            if z > a:
                b.copy(Slice("src", start + a, start + z), Slice("slots", a, z, index=rank), itemsize=itemsize)
        b.signal(2 * k + 1)

    copy_in(0)
    for k, start in enumerate(starts):
        items = min(block_items, count - start)
        bounds = shm_part_bounds(items, n, align)
        lo, hi = bounds[rank]
        b.wait(2 * k + 1)
        if hi > lo:
            mine = Slice("dst", start + lo, start + hi)
            first = Slice("src", start + lo, start + hi)
            for q in (q for q in range(n) if q != rank):
                b.reduce(first, Slice("slots", lo, hi, index=q), mine, itemsize=itemsize)
                first = mine
            b.finish(mine, n, itemsize=itemsize)
            b.copy(mine, Slice("results", 0, hi - lo, index=rank), itemsize=itemsize)
        b.signal(2 * k + 2)
        if k + 1 < len(starts):
            copy_in(k + 1)
        b.wait(2 * k + 2)
        for q, (qlo, qhi) in enumerate(bounds):
            if q != rank and qhi > qlo:
                b.copy(
                    Slice("results", 0, qhi - qlo, index=q), Slice("dst", start + qlo, start + qhi), itemsize=itemsize
                )
