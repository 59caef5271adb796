"""Allreduce, broadcast, barrier and argument agreement through one shared-memory segment, for the ranks of one host.

The segment itself (its creation, the per-rank counters, waiting, liveness and the abort word) is
:class:`paratrain.shm.segment.Segment`; the group's creation and its agreement step are
:class:`~paratrain.collectives.shm_members.ShmMembers`; this module is the collective protocol on it: what the
counters count, who may write which slot and descriptor at which step, and the collectives that move data.

The agreement step, the two allreduce paths and broadcast read and write the same slots under one numbering of
blocks (who may write which slot at which counter value, and why no barrier is needed between calls); call
descriptions and their encoding are in :mod:`.signature`.

Slot use: each slot of the segment (two per rank, positions 0 and 1, used by alternate blocks) is an input
area (``capacity`` bytes) followed by a result area (``capacity / N`` bytes, the segment's "extra" area); each
descriptor holds the call's signature (kind, op, dtype, shape, algorithm, root), ``Signature.encode()``.

Agreement: the first block of every call (and every barrier) is also its agreement step. Each rank writes its
call's signature into its descriptor of that block's position before it publishes the block, and after the
wait for every peer's ``in(k)`` compares every rank's descriptor with its own (byte compare; decoded only when
they differ). On a difference every rank computes the same :func:`~paratrain.collectives.signature.mismatch`
from the same descriptors and raises the same ``CollectiveMismatchError``, before reading any peer's data: all
ranks leave the call at the same step (counter ``2k+1``, next block ``k+1``), exactly as after a one-block
call on the one-phase path, so the group stays usable and the next call needs nothing special. A rank that
rejects its own arguments (ValueError, TypeError) takes part in that step with an "invalid" signature before it
raises, so its peers fail at once too. Only a lost peer, a timeout, or an error in the middle of the data phase
breaks the group (the segment's abort word).

Arrays larger than ``capacity`` go through in blocks of ``capacity`` bytes: memory stays fixed, and a block
stays in cache (L2/L3) while it travels between ranks (a rank fills the next block's slot while slower peers
still read the previous one).

Allreduce of block ``k`` by rank r (the block split in N cache-line-aligned parts; rank r owns part r)::

    in(k)    copy the parts q != r of block k of my array into my input area                -> counter = 2k+1
    red(k)   wait counter(q) >= 2k+1 for all q; my array's part r (+)= part r of every peer's
             input area; copy the result into my result area                                 -> counter = 2k+2
    in(k+1)  pipelined: copy the next block in while the peers still reduce this one
    out(k)   wait counter(q) >= 2k+2 for all q; copy part q of the result from q's result area, for q != r

Per rank that is ``(N-1)/N`` of the array copied in, ``1/N`` reduced from N sources, ``1/N`` published and
``(N-1)/N`` copied out: the fewest passes possible without reading peers' private memory directly. Arrays of at
most ``small_bytes`` take a one-phase path instead: every rank copies its whole array in, waits once, and
reduces all input areas itself, in rank order, so that every rank computes the same bits. One synchronisation
instead of two wins while reducing the whole array costs less than a cross-core hand-off.

Why one counter per rank is enough: counters only grow, block numbers continue across calls, and every rank
waits for every peer's ``in(k)`` before its own ``red(k)``. When I start ``in(k)`` I have seen every peer's
``in(k-1)``, which each peer does after its ``red(k-2)``: nobody reads the input areas of position ``k % 2``
any more. When I write my result of block ``k`` I have seen every peer's ``in(k)``, which each does after its
``out(k-2)``: nobody reads the result areas of that position any more. (Results have their own area because a
peer may still copy out result ``k-2`` while I copy block ``k`` in, and the parts move when the length changes.)
So consecutive collectives need no barrier between them. Memory ordering and waiting: see
:mod:`paratrain.shm.segment`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.ops import Reducer
from paratrain.collectives.shm_call import check_array
from paratrain.collectives.shm_layout import (
    DEFAULT_CAPACITY,
    DEFAULT_SMALL_BYTES,
    block_items,
    plan_args,
)
from paratrain.collectives.shm_members import HostContext, ShmMembers
from paratrain.collectives.signature import Signature
from paratrain.shm.segment import DEFAULT_SPIN_MAX_S, DEFAULT_SPIN_S, SLICE_S, Segment

if TYPE_CHECKING:
    from paratrain.collectives.exchange import Exchange

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SMALL_BYTES",
    "DEFAULT_SPIN_MAX_S",
    "DEFAULT_SPIN_S",
    "SLICE_S",
    "HostContext",
    "ShmAllreduce",
    "ShmGroup",
    "block_items",
    "plan_args",
]

_Array = npt.NDArray[Any]


class ShmGroup(ShmMembers):
    """The ranks of one host, joined by a shared-memory segment for fast collectives.

    Create it collectively with :meth:`create` (or :meth:`from_context`); every member then calls the same
    collectives in the same order. Calls block until the collective completes on this rank, and raise instead of
    hanging when a peer dies, leaves, fails, or exceeds the timeout. Not thread-safe: one thread per rank uses
    a group (concurrent use raises ``RuntimeError``). Memory is fixed: ``2 * (capacity + capacity / N)`` bytes
    of shared memory per rank, whatever the array sizes.

    Every call starts with an agreement (see the module notes): when members pass different kinds, shapes,
    dtypes, ops or roots, every member raises the same ``CollectiveMismatchError`` and the group stays usable;
    so does it when a member rejects its own arguments (it raises its ``ValueError``, the others
    ``CollectiveMismatchError``). After any other error (a peer lost, a timeout, an interrupt in mid-call) the
    group is broken: close it.

    Attributes:
        segment: the shared memory (:class:`~paratrain.shm.segment.Segment`).
        ranks: the member ranks (transport ranks), sorted.
        rank: this process's transport rank.
        index: this rank's position in ``ranks``.
        size: number of members.
        capacity: bytes per pipeline block.
        timeout: default timeout of each collective (seconds).

    Example:
        >>> import numpy as np
        >>> from paratrain.testing import run_ranks
        >>> def body(ctx):
        ...     group = ShmGroup.create(ctx.transport, ranks=range(ctx.world_size), run_id=ctx.settings.run_id,
        ...                             timeout=ctx.settings.timeout, tag=ctx.next_collective_tag())
        ...     x = np.full(5, ctx.rank + 1.0, dtype=np.float32)
        ...     group.allreduce_(x, "sum")
        ...     group.close()
        ...     return x.tolist()
        >>> run_ranks(2, body)[1]
        [3.0, 3.0, 3.0, 3.0, 3.0]
    """

    def __init__(self, segment: Segment, *, small_bytes: int) -> None:
        """Runs collectives on a segment created for them; use :meth:`create`, which creates it collectively."""
        super().__init__(segment)
        self.small_bytes = min(small_bytes, self.capacity)
        self._reducers: dict[tuple[str, str], Reducer] = {}
        #: seconds this rank's allreduces spent copying into the segment, reducing (its part, published),
        #: copying results out and waiting for peers, and how many calls: where an allreduce's time goes
        #: (``paratrain bench train`` reports it)
        self.phases: dict[str, float] = {"copy_in": 0.0, "reduce": 0.0, "copy_out": 0.0, "wait": 0.0, "calls": 0}

    # -- public collectives ------------------------------------------------------------------------------------

    def allreduce_(
        self,
        arr: _Array,
        op: str = "sum",
        *,
        dtype_name: str | None = None,
        timeout: float | None = None,
        signature: Signature | None = None,
    ) -> None:
        """Reduces ``arr`` element-wise across the group, in place, on every rank. Collective; blocks.

        Args:
            arr: a writeable C-contiguous numpy array; same shape and dtype on every rank.
            op: ``"sum"``, ``"mean"`` (floor division for integers), ``"max"`` or ``"min"``; the semantics of
                :class:`~paratrain.collectives.ops.Reducer`.
            dtype_name: ``"bfloat16"`` when ``arr`` holds bfloat16 bit patterns as uint16 (each combine goes
                through float32, as in :mod:`paratrain.collectives.ops`); otherwise None or the array's dtype name.
            timeout: seconds for the whole call (default ``self.timeout``).
            signature: what the ranks compare, if not ``arr``'s own shape, dtype and ``op`` with algorithm
                ``"shm"``: the collectives API passes the caller's signature here (``arr`` is then a flat view).

        Raises:
            CollectiveMismatchError: ranks passed different shapes, dtypes or ops, or one called another
                collective, or one rejected its arguments; raised on every rank, and the group stays usable.
            ValueError, TypeError: this rank's arguments are invalid (the peers learn it; the group stays usable).
            PeerLostError: a peer died, left, or failed inside the collective.
            CommTimeoutError: a peer did not take part within the timeout.
        """
        with self._call:
            deadline = self._deadline(timeout)
            try:
                flat, name = check_array(arr, dtype_name)
                red = self._reducer(op, name)
                if signature is None:
                    desc = self._descs.own("allreduce", op, name, arr.shape, None)
                else:
                    desc = self._descs.encode(signature, name, flat.size)
            except (ValueError, TypeError) as exc:
                self._reject(exc, deadline)
            self._allreduce(flat, red, desc, deadline)

    def allreduce_described_(self, flat: _Array, red: Reducer, desc: bytes, *, timeout: float) -> None:
        """:meth:`allreduce_` for a caller that has done its checks itself: ``flat`` is a 1-d, C-contiguous,
        writeable array of the dtype ``red`` reduces, and ``desc`` is :meth:`describe` of the call's signature.

        The collectives API's per-shape fast path (:meth:`Collectives.allreduce_
        <paratrain.collectives.api.Collectives.allreduce_>`): a small allreduce takes ~9 µs here, and the checks
        and lookups it skips cost a few more. Raises as :meth:`allreduce_`.
        """
        with self._call:
            self._allreduce(flat, red, desc, self._deadline(timeout))

    def describe(self, signature: Signature) -> bytes:
        """``signature`` as the group's agreement step compares it (encoded once, then cached)."""
        return self._descs.encode(signature)

    def _allreduce(self, flat: _Array, red: Reducer, desc: bytes, deadline: float) -> None:
        if not self.segment.mapped:
            return
        if flat.size == 0:
            self._agree(desc, deadline)
        elif flat.nbytes <= self.small_bytes:
            self._allreduce_small(flat, red, desc, deadline)
        else:
            self._allreduce_blocks(flat, red, desc, deadline)

    def broadcast_(
        self, arr: _Array, root: int, *, timeout: float | None = None, signature: Signature | None = None
    ) -> None:
        """Copies ``arr`` of rank ``root`` (a transport rank in ``ranks``) into ``arr`` of every rank. Blocks.

        Raises:
            CollectiveMismatchError: ranks passed different shapes, dtypes or roots (on every rank; the group
                stays usable).
            ValueError, TypeError, PeerLostError, CommTimeoutError: as for :meth:`allreduce_`.
        """
        with self._call:
            deadline = self._deadline(timeout)
            try:
                if root not in self.ranks:
                    raise ValueError(f"root {root} is not a member of the group {list(self.ranks)}")
                flat, name = check_array(arr, None)
                if signature is None:
                    desc = self._descs.own("broadcast", None, name, arr.shape, root)
                else:
                    desc = self._descs.encode(signature, name, flat.size)
            except (ValueError, TypeError) as exc:
                self._reject(exc, deadline)
            if not self.segment.mapped:
                return
            if flat.size == 0:
                self._agree(desc, deadline)
            else:
                self._broadcast(flat, self.ranks.index(root), desc, deadline)

    # -- the algorithms ----------------------------------------------------------------------------------------

    def _allreduce_small(self, flat: _Array, red: Reducer, desc: bytes, deadline: float) -> None:
        seg, clock, phases = self.segment, time.perf_counter, self.phases
        t0 = clock()
        k = self._k
        pos = k & 1
        plan = self._layout.plan(flat.dtype, flat.size)
        slots = plan.whole[pos]
        slots[self.index][...] = flat  # not np.copyto: its dispatch costs ~0.2 µs, a few % of a small call
        seg.describe(pos, desc)
        seg.signal(2 * k + 1)
        t1 = clock()
        seg.wait_all(2 * k + 1, deadline)
        t2 = clock()
        self._check_descriptors(k, desc)
        self._k = k + 1
        red.combine(slots[0], slots[1], flat)  # in rank order on every rank: bitwise equal results
        for q in range(2, self.size):
            red.combine(flat, slots[q], flat)
        red.finish(flat, self.size)
        t3 = clock()
        phases["copy_in"] += t1 - t0
        phases["wait"] += t2 - t1
        phases["reduce"] += t3 - t2
        phases["calls"] += 1

    def _allreduce_blocks(self, flat: _Array, red: Reducer, desc: bytes, deadline: float) -> None:
        seg = self.segment
        me, size = self.index, self.size
        per_block = self._block_elems(flat.dtype, parts=size)
        total = flat.size
        starts = range(0, total, per_block)
        k0 = self._k
        last = len(starts) - 1
        clock, phases = time.perf_counter, self.phases
        t = clock()
        self._copy_in(flat, 0, min(per_block, total), k0, desc)
        copy_in, wait, reduce, copy_out = clock() - t, 0.0, 0.0, 0.0
        for i, start in enumerate(starts):
            k = k0 + i
            n = min(per_block, total - start)
            plan = self._layout.plan(flat.dtype, n)
            pos = k & 1
            t0 = clock()
            seg.wait_all(2 * k + 1, deadline)
            t1 = clock()
            if i == 0:
                self._check_descriptors(k, desc)
            lo, hi = plan.bounds[me]
            if hi > lo:
                mine = flat[start + lo : start + hi]
                self._reduce_part(mine, plan.peer_mine[pos], red)
                np.copyto(plan.own[pos], mine)
            seg.signal(2 * k + 2)
            t2 = clock()
            if i < last:
                nxt = start + per_block
                self._copy_in(flat, nxt, min(per_block, total - nxt), k + 1, None)
            t3 = clock()
            seg.wait_all(2 * k + 2, deadline)
            t4 = clock()
            for src, qlo, qhi in plan.peer_own[pos]:
                np.copyto(flat[start + qlo : start + qhi], src)
            t5 = clock()
            wait += (t1 - t0) + (t4 - t3)
            reduce += t2 - t1
            copy_in += t3 - t2
            copy_out += t5 - t4
        self._k = k0 + last + 1
        phases["copy_in"] += copy_in
        phases["wait"] += wait
        phases["reduce"] += reduce
        phases["copy_out"] += copy_out
        phases["calls"] += 1

    def _copy_in(self, flat: _Array, start: int, n: int, k: int, desc: bytes | None) -> None:
        """``in(k)``: copies the parts of block ``k`` that peers reduce into my slot (and the call's descriptor, for
        its first block), then signals."""
        plan = self._layout.plan(flat.dtype, n)
        slot = plan.whole[k & 1][self.index]
        lo, hi = plan.bounds[self.index]
        if lo > 0:
            np.copyto(slot[:lo], flat[start : start + lo])
        if hi < n:
            np.copyto(slot[hi:], flat[start + hi : start + n])
        if desc is not None:
            self.segment.describe(k & 1, desc)
        self.segment.signal(2 * k + 1)

    def _reduce_part(self, mine: _Array, sources: Sequence[_Array], red: Reducer) -> None:
        for src in sources:
            red.combine(mine, src, mine)
        red.finish(mine, self.size)

    def _broadcast(self, flat: _Array, root: int, desc: bytes, deadline: float) -> None:
        seg = self.segment
        per_block = self._block_elems(flat.dtype, parts=1)
        k0 = self._k
        for i, start in enumerate(range(0, flat.size, per_block)):
            k = k0 + i
            n = min(per_block, flat.size - start)
            slots = self._layout.plan(flat.dtype, n).whole[k & 1]
            if self.index == root:
                np.copyto(slots[root], flat[start : start + n])
            if i == 0:
                seg.describe(k & 1, desc)
            seg.signal(2 * k + 1)
            seg.wait_all(2 * k + 1, deadline)
            if i == 0:
                self._check_descriptors(k, desc)
            if self.index != root:
                np.copyto(flat[start : start + n], slots[root])
            self._k = k + 1

    def publish(
        self,
        flat: _Array,
        sizes: Sequence[int],
        reads: Sequence[tuple[int, int, int, int]],
        out: _Array,
        *,
        order: Sequence[tuple[int, int]] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Moves blocks of every member's ``flat`` (``sizes[q]`` items at member q, one dtype) to whoever reads
        them: each read ``(q, start, stop, at)`` copies items ``[start, stop)`` of member q's array to
        ``out[at:]``. Gather (the root reads every member's array), scatter (every member reads its part of the
        root's) and all-to-all (each reads its part of everybody's) are this. Collective; blocks. The call's
        agreement came first (the sizes are known to all). ``order``: the pieces of ``flat`` this member
        publishes, in order (default: all of it); items are then numbered along them (what the peers' reads
        and ``sizes`` count), so all-to-all can publish, in round j, the part member ``q + j`` reads, and every
        member reads in every round instead of one at a time.

        Blocks of ``capacity`` bytes, as :meth:`broadcast_`: in block i every member copies items ``[iB, iB + B)``
        of its array into its slot, signals, waits for all, then copies out what it reads of everybody's block i;
        a slot is written again two blocks later, once every member has signalled the block between (so has read
        this one). Each item crosses memory twice (in, out), as through MPI's shared memory.

        Raises:
            PeerLostError, CommTimeoutError: as for :meth:`allreduce_`.
        """
        with self._call:
            if not self.segment.mapped:
                return
            deadline = self._deadline(timeout)
            seg = self.segment
            per_block = self._block_elems(flat.dtype, parts=1)
            blocks = max((-(-size // per_block) for size in sizes), default=0)
            k0 = self._k
            pieces = [(0, sizes[self.index])] if order is None else list(order)
            for i in range(blocks):
                k = k0 + i
                lo, hi = i * per_block, (i + 1) * per_block
                slots = self._layout.plan(flat.dtype, per_block).whole[k & 1]
                at = 0  # where piece p starts along the published items
                for a, z in pieces:
                    x, y = max(lo, at), min(hi, at + z - a)  # the piece's items inside this block
                    if x < y:
                        np.copyto(slots[self.index][x - lo : y - lo], flat[a + x - at : a + y - at])
                    at += z - a
                reading = [r for r in reads if max(r[1], lo) < min(r[2], hi, sizes[r[0]])]
                seg.signal(2 * k + 1)
                seg.wait_all(2 * k + 1, deadline, spin=bool(reading) or i + 1 == blocks)
                for q, start, stop, at in reading:
                    a, z = max(start, lo), min(stop, hi, sizes[q])
                    if a < z:
                        np.copyto(out[at + a - start : at + z - start], slots[q][a - lo : z - lo])
                self._k = k + 1

    def _block_elems(self, dtype: np.dtype[Any], *, parts: int) -> int:
        """Elements per block: as many as fit, a multiple of ``parts`` cache-line-aligned pieces."""
        return self._layout.block_elems(dtype, parts=parts)

    def _reducer(self, op: str, name: str) -> Reducer:
        red = self._reducers.get((op, name))
        if red is None:
            red = self._reducers[(op, name)] = Reducer(op, name)
        return red


class ShmAllreduce:
    """The shared-memory allreduce as the ``run`` of an ``AllreduceAlgorithm`` in ``Collectives.allreduce_algorithms``
    (``run(ex, src, dst, reducer)``), and the agreement step of every other collective of the same ranks
    (:meth:`agree`); the group is created collectively on first use, over that call's tag.

    Every rank must be on this host (or pass the host's ``ranks``). Not thread-safe, like the group.

    Example:
        >>> from paratrain.testing import run_ranks
        >>> from paratrain.collectives.api import AllreduceAlgorithm
        >>> def body(ctx):
        ...     shm = ShmAllreduce(run_id=ctx.settings.run_id)
        ...     ctx.collectives.allreduce_algorithms["shm"] = AllreduceAlgorithm(shm)
        ...     x = ctx.allreduce(np.arange(3.0), algorithm="shm")
        ...     shm.close()
        ...     return x.tolist()
        >>> run_ranks(2, body)[0]
        [0.0, 2.0, 4.0]
    """

    def __init__(
        self,
        *,
        run_id: str,
        ranks: Sequence[int] | None = None,
        capacity: int = DEFAULT_CAPACITY,
        small_bytes: int = DEFAULT_SMALL_BYTES,
        spin: float = DEFAULT_SPIN_S,
        spin_max: float = DEFAULT_SPIN_MAX_S,
    ) -> None:
        self._run_id = run_id
        self._ranks = None if ranks is None else list(ranks)
        self._options: dict[str, Any] = {
            "capacity": capacity,
            "small_bytes": small_bytes,
            "spin": spin,
            "spin_max": spin_max,
        }
        self.group: ShmGroup | None = None

    def __call__(self, ex: Exchange, src: _Array, dst: _Array, reducer: Reducer) -> None:
        """Reduces ``src`` of every rank into ``dst`` (which may be ``src``). Collective; blocks.

        Compares ``ex.signature`` (the caller's shape, algorithm names...) if the API set it, else the flat
        arrays' own, in the group's agreement step.
        """
        group = self._group(ex)
        if dst is not src:
            np.copyto(dst, src)
        group.allreduce_(
            dst, reducer.op, dtype_name=reducer.dtype_name, timeout=max(ex.left(), 0.001), signature=ex.signature
        )

    def agree(self, ex: Exchange, signature: Signature) -> list[Signature]:
        """Every member's ``signature`` through the segment (:meth:`ShmGroup.agree`). Collective; blocks.

        Raises:
            CollectiveMismatchError: they differ (on every member; the group stays usable).
        """
        return self._group(ex).agree(signature, timeout=max(ex.left(), 0.001))

    def _group(self, ex: Exchange) -> ShmGroup:
        """The group, created collectively (over ``ex``'s tag) by the first call."""
        if self.group is None:
            self.group = ShmGroup.create(
                ex.transport,
                ranks=self._ranks if self._ranks is not None else list(range(ex.world_size)),
                run_id=self._run_id,
                timeout=ex.timeout,
                tag=ex.tag,
                **self._options,
            )
        return self.group

    def close(self) -> None:
        """Closes the group if one was created. Idempotent."""
        if self.group is not None:
            self.group.close()
