"""Where a shared-memory collective's blocks lie: block sizes, and each rank's input and result areas per block.

Each slot of the segment (two per rank, positions 0 and 1, used by alternate blocks) is an input area
(``capacity`` bytes) followed by a result area (``capacity / N`` bytes, the segment's "extra" area). A block is
split in N cache-line-aligned parts; rank r owns part r (see :mod:`paratrain.collectives.shm` for the protocol).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.lower_shm import shm_part_bounds
from paratrain.shm.segment import Segment

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SMALL_BYTES",
    "BlockPlan",
    "SlotLayout",
    "block_items",
    "plan_args",
    "result_bytes",
]

#: Bytes of one pipeline block (the segment holds 2 blocks per rank). Larger blocks cost fewer Python calls per
#: byte; smaller ones keep a block in the L2 cache. 1 MiB measured best on a 2-core EPYC (1 MiB L2 per core, 32 MiB L3).
DEFAULT_CAPACITY = 1 << 20
#: Arrays up to this many bytes use the one-phase path (one synchronisation; every rank reduces everything).
#: Measured on 2 cores: the one-phase path wins up to ~128 KiB with 2 ranks and ~64 KiB with 4 (it reduces N
#: arrays per rank, so its cost grows with N while the two-phase path's extra hand-off stays ~5 µs).
DEFAULT_SMALL_BYTES = 64 << 10

_ALIGN = 64
_PLAN_CACHE = 16

_Array = npt.NDArray[Any]


def block_items(capacity: int, itemsize: int, parts: int) -> int:
    """Elements per pipeline block of an allreduce (``parts`` = ranks) or broadcast (1): as many as fit in
    ``capacity`` bytes, a multiple of ``parts`` cache-line-aligned pieces. Pure: the simulator asks it too.

    Example:
        >>> block_items(1 << 20, 4, 4)
        262144
    """
    align = max(1, _ALIGN // itemsize)
    unit = parts * align
    return max(unit, capacity // itemsize // unit * unit)


def plan_args(
    n: int, itemsize: int, *, capacity: int = DEFAULT_CAPACITY, small_bytes: int = DEFAULT_SMALL_BYTES
) -> tuple[int, int, int]:
    """``shm=`` of :func:`~paratrain.collectives.lower.allreduce_plan` for a group of ``n`` with these settings:
    (block items, alignment in items, one-phase limit in bytes), as
    :class:`~paratrain.collectives.shm.ShmAllreduce` runs them."""
    return block_items(capacity, itemsize, n), max(1, _ALIGN // itemsize), min(small_bytes, capacity)


def result_bytes(nranks: int, capacity: int) -> int:
    """Bytes of a slot's result area: one part of a full block, page-aligned."""
    return (-(-capacity // nranks) + 4095) // 4096 * 4096


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """Precomputed views for one block length of one dtype (building numpy views costs ~0.3 µs each)."""

    n: int
    bounds: tuple[tuple[int, int], ...]
    whole: tuple[tuple[_Array, ...], ...]  # [pos][q]: input area of slot (q, pos), n elements
    own: tuple[_Array, ...]  # [pos]: my result area (my part of the reduced block)
    peer_own: tuple[tuple[tuple[_Array, int, int], ...], ...]  # [pos]: (q's result area, lo, hi) for q != me
    peer_mine: tuple[tuple[_Array, ...], ...]  # [pos]: part r of q's input area (inputs to my reduction), q != me


class SlotLayout:
    """The views of a segment's slots for each block length and dtype, built once and kept (a few per group).

    Args:
        segment: the group's segment (its slots hold ``capacity`` input bytes and a result area each).
    """

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.capacity = segment.capacity
        self._plans: OrderedDict[tuple[np.dtype[Any], int], BlockPlan] = OrderedDict()

    def block_elems(self, dtype: np.dtype[Any], *, parts: int) -> int:
        """Elements per block: as many as fit, a multiple of ``parts`` cache-line-aligned pieces."""
        return block_items(self.capacity, dtype.itemsize, parts)

    def plan(self, dtype: np.dtype[Any], n: int) -> BlockPlan:
        """The views of a block of ``n`` elements of ``dtype``."""
        key = (dtype, n)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        seg = self.segment
        size, me, others, u8, at = seg.size, seg.index, seg.others, seg.u8, seg.slot_offset
        bounds = tuple(shm_part_bounds(n, size, max(1, _ALIGN // dtype.itemsize)))  # the plan's parts
        whole = tuple(
            tuple(u8[at(q, pos) : at(q, pos) + n * dtype.itemsize].view(dtype) for q in range(size)) for pos in (0, 1)
        )
        lo, hi = bounds[me]
        own = tuple(self._result(me, pos, dtype, hi - lo) for pos in (0, 1))
        peer_own = tuple(
            tuple(
                (self._result(q, pos, dtype, bounds[q][1] - bounds[q][0]), *bounds[q])
                for q in others
                if bounds[q][1] > bounds[q][0]
            )
            for pos in (0, 1)
        )
        peer_mine = tuple(tuple(whole[pos][q][lo:hi] for q in others) for pos in (0, 1))
        plan = BlockPlan(n=n, bounds=bounds, whole=whole, own=own, peer_own=peer_own, peer_mine=peer_mine)
        self._plans[key] = plan
        if len(self._plans) > _PLAN_CACHE:
            self._plans.popitem(last=False)
        return plan

    def _result(self, q: int, pos: int, dtype: np.dtype[Any], n: int) -> _Array:
        """The result area of slot ``(q, pos)``: separate from the inputs, because a peer may still copy out my
        result of block ``k - 2`` while I already copy block ``k``'s inputs in (whose parts may lie anywhere
        when the block length changes)."""
        start = self.segment.slot_offset(q, pos) + self.capacity
        return self.segment.u8[start : start + n * dtype.itemsize].view(dtype)

    def clear(self) -> None:
        """Drops the views of the mapping: the segment can unmap only once they are gone."""
        self._plans.clear()
