"""Allreduce, broadcast, barrier and argument agreement through one shared-memory segment, for the ranks of one host.

Why: between processes of one host, TCP or ipc sockets copy every byte twice through the kernel and wake the
receiver through the scheduler (~40 µs per hop here). A segment mapped by every rank needs one copy in and one
copy out, and a waiter that spins on its peers' counters sees their progress within a cache-line transfer.
This is how MPI's shared-memory transports beat sockets inside a host.

Why one module of this size: the segment layout, the per-rank counters, the call-description agreement and the
collectives that move data all read and write the same offsets under the same protocol (who may write which
slot at which sequence number); splitting them would spread one memory protocol over files that must change
together. The pure parts (call descriptions and their encoding) live in :mod:`.signature`.

Segment layout (all offsets 8-byte aligned; one 128-byte control line per rank, so that a rank's writes never
share a cache line with another rank's)::

    [ header 4 KiB | control line of rank 0 .. N-1 | descriptor (rank 0, pos 0), (0, 1), (1, 0), ...
      | slot (rank 0, pos 0), (0, 1), (1, 0), ... ]
    control line of rank r: counter | sleeping-on | pid | left
    descriptor: the call's signature (kind, op, dtype, shape, algorithm, root), Signature.encode()
    slot: input area (capacity bytes) | result area (capacity / N bytes)

Agreement: the first block of every call (and every barrier) is also its agreement step. Each rank writes its
call's signature into its descriptor of that block's position before it publishes the block, and after the
wait for every peer's ``in(k)`` compares every rank's descriptor with its own (byte compare; decoded only when
they differ). On a difference every rank computes the same :func:`~paratrain.collectives.signature.mismatch`
from the same descriptors and raises the same ``CollectiveMismatchError``, before reading any peer's data: all
ranks leave the call at the same step (counter ``2k+1``, next block ``k+1``), exactly as after a one-block
call on the one-phase path, so the group stays usable and the next call needs nothing special. A rank that
rejects its own arguments (ValueError, TypeError) takes part in that step with an "invalid" signature before it
raises, so its peers fail at once too. Only a lost peer, a timeout, or an error in the middle of the data phase
breaks the group (the abort word, below).

Each rank owns two slots (positions 0 and 1, used by alternate blocks, so that a rank can fill the next block
while slower peers still read the previous one). Arrays larger than ``capacity`` go through in blocks of
``capacity`` bytes: memory stays fixed, and a block stays in cache (L2/L3) while it travels between ranks.

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
So consecutive collectives need no barrier between them.

Memory ordering: this relies on x86-64's total store order: the data stores of a copy become visible before
the counter store that follows them, and a reader's data loads are not performed before its counter load.
CPython makes both opaque C calls (numpy copies, ``memoryview`` stores), so the compiler cannot reorder them
either. The one reordering x86 does allow, a store passing a later load, matters only between a counter store
and the check for sleeping waiters; a locked instruction (a lock round trip) fences it, see ``_signal``.
Weaker architectures (ARM, POWER) would need explicit fences that Python does not offer, so
:meth:`ShmGroup.supported` is False there and callers must choose another algorithm.

Waiting: spin on the peer's counter for ``spin`` seconds (``sched_yield`` in the loop when there are more
ranks than cores, so the spinner gives its core to the rank it waits for; the spin adapts up to ``spin_max``
when waits keep ending just after it, see ``ShmGroup._adapt_spin``), then sleep on the counter with a
futex (see :mod:`paratrain.collectives.futex`) in slices of :data:`SLICE_S`, checking between slices for an
aborted group, a peer that left or died, and the deadline. A rank that fails mid-collective sets the abort word
and wakes everyone, so no peer hangs. Members that are threads of one process never spin: the spinner would hold
the GIL that its peer needs to make progress.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import mmap
import os
import platform
import secrets
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import numpy.typing as npt

from paratrain._arrays import dtype_name as _wire_dtype_name
from paratrain.collectives import futex
from paratrain.collectives.ops import Reducer
from paratrain.collectives.signature import DESCRIPTOR_BYTES, INVALID, Signature, mismatch_error
from paratrain.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    PeerLostError,
    TransportError,
)

if TYPE_CHECKING:
    from paratrain.collectives.tree import Exchange
    from paratrain.runtime.context import Context
    from paratrain.transport.base import Transport

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SMALL_BYTES",
    "DEFAULT_SPIN_MAX_S",
    "DEFAULT_SPIN_S",
    "SLICE_S",
    "ShmAllreduce",
    "ShmGroup",
]

log = logging.getLogger("paratrain.collectives.shm")

#: Bytes of one pipeline block (the segment holds 2 blocks per rank). Larger blocks cost fewer Python calls per
#: byte; smaller ones keep a block in the L2 cache. 1 MiB measured best on a 2-core EPYC (1 MiB L2 per core, 32 MiB L3).
DEFAULT_CAPACITY = 1 << 20
#: Arrays up to this many bytes use the one-phase path (one synchronisation; every rank reduces everything).
#: Measured on 2 cores: the one-phase path wins up to ~128 KiB with 2 ranks and ~64 KiB with 4 (it reduces N
#: arrays per rank, so its cost grows with N while the two-phase path's extra hand-off stays ~5 µs).
DEFAULT_SMALL_BYTES = 64 << 10
#: Seconds a waiter spins before sleeping on a futex. Waking a sleeping process costs ~40 µs on another core,
#: so spinning about as long keeps small collectives fast; longer spins waste a core while a peer is late.
DEFAULT_SPIN_S = 100e-6
#: Longest spin that adaptation may reach (see ``ShmGroup._adapt_spin``). It must exceed the slowest wake-up of a
#: sleeping process, or ranks stay in the slow sleep/wake regime: on the 2-vCPU VM of the benchmarks, wake-ups
#: of over 1 ms happen, and 1 ms left ~1 run in 3 there (mean 4 KiB time 20-46 µs instead of 9); 5 ms did not.
#: (Yielding the core past the base spin was tried, and was slower: a yielding rank waits out the time slice of
#: whatever ran instead.)
DEFAULT_SPIN_MAX_S = 5e-3
#: Longest futex sleep; between slices a waiter checks for dead or departed peers, aborts and its deadline.
SLICE_S = 0.05

_MAGIC = 0x3130304D48535450  # b"PTSHM001" little-endian
_VERSION = 2  # 2: descriptors are whole signatures, in an area of their own
_HEADER = 4096
_LINE = 128
_ALIGN = 64
_W_MAGIC, _W_VERSION, _W_NRANKS, _W_CAPACITY, _W_ABORT, _W_ABORT_WHY, _W_ABORT_LOST = range(7)
# Words of a control line (relative to its first word).
_C_COUNTER, _C_SLEEP, _C_PID, _C_LEFT = 0, 1, 2, 3
_WHY_ERROR, _WHY_MISMATCH, _WHY_LOST = 1, 2, 3
_PLAN_CACHE = 16
_DESC_CACHE = 64  # encoded signatures kept per group (encoding costs ~1 µs, a lookup ~0.1 µs)
#: The algorithm name in the signatures of the group's own calls (the API passes its own signatures instead).
ALGORITHM = "shm"
_BARRIER = Signature("barrier", None, "", (), ALGORITHM, ALGORITHM)
_NAMES: dict[np.dtype[Any], str] = {}  # dtype -> wire name (computing it costs ~4 µs, a fifth of a small call)

_Array = npt.NDArray[Any]


def _segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _result_bytes(nranks: int, capacity: int) -> int:
    """Bytes of a slot's result area: one part of a full block, page-aligned."""
    return (-(-capacity // nranks) + 4095) // 4096 * 4096


def _pages(nbytes: int) -> int:
    return (nbytes + 4095) // 4096 * 4096


def _descriptors_offset(nranks: int) -> int:
    return _HEADER + _pages(nranks * _LINE)


def _segment_bytes(nranks: int, capacity: int) -> int:
    data = _descriptors_offset(nranks) + _pages(nranks * 2 * DESCRIPTOR_BYTES)
    return data + nranks * 2 * (capacity + _result_bytes(nranks, capacity))


def _process_dead(pid: int) -> bool:
    """True if ``pid`` has exited (also as an unreaped zombie, which ``kill(pid, 0)`` would call alive)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except (OSError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


@dataclass(frozen=True, slots=True)
class _Plan:
    """Precomputed views for one block length of one dtype (building numpy views costs ~0.3 µs each)."""

    n: int
    bounds: tuple[tuple[int, int], ...]
    whole: tuple[tuple[_Array, ...], ...]  # [pos][q]: input area of slot (q, pos), n elements
    own: tuple[_Array, ...]  # [pos]: my result area (my part of the reduced block)
    peer_own: tuple[tuple[tuple[_Array, int, int], ...], ...]  # [pos]: (q's result area, lo, hi) for q != me
    peer_mine: tuple[tuple[_Array, ...], ...]  # [pos]: part r of q's input area (inputs to my reduction), q != me


class ShmGroup:
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
        ...     group = ShmGroup.from_context(ctx)
        ...     x = np.full(5, ctx.rank + 1.0, dtype=np.float32)
        ...     group.allreduce_(x, "sum")
        ...     group.close()
        ...     return x.tolist()
        >>> run_ranks(2, body)[1]
        [3.0, 3.0, 3.0, 3.0, 3.0]
    """

    def __init__(
        self,
        *,
        transport: Transport,
        ranks: Sequence[int],
        mm: mmap.mmap | None,
        timeout: float,
        spin: float,
        small_bytes: int,
        spin_max: float = DEFAULT_SPIN_MAX_S,
    ) -> None:
        """Wraps an already mapped segment; use :meth:`create`, which maps it collectively."""
        self.ranks = tuple(ranks)
        self.rank = transport.rank
        self.index = self.ranks.index(self.rank)
        self.size = len(self.ranks)
        self.timeout = timeout
        self._transport = transport
        self._spin = spin
        self._spin_max = max(spin, spin_max)
        self._spin_now = spin
        self._yield = self.size > _cpu_count()
        self._lock = threading.Lock()
        self._fence_lock = threading.Lock()
        self._broken: str | None = None  # the error text only: the exception's frames would pin views of the mmap
        self._closed = False
        self._k = 0  # next block number
        self._x = 0  # neighbour exchanges published (a group does collectives or exchanges, never both)
        self._plans: OrderedDict[tuple[np.dtype[Any], int], _Plan] = OrderedDict()
        self._reducers: dict[tuple[str, str], Reducer] = {}
        self._descs: dict[tuple[Any, ...], bytes] = {}  # signature (or its key) -> encoded descriptor
        self._mm = mm
        if mm is None:
            self.capacity = 0
            self.small_bytes = 0
            return
        self._seg = mm
        self._u8: _Array = np.frombuffer(mm, dtype=np.uint8)
        self._w: memoryview = memoryview(mm).cast("Q")
        self._addr = int(self._u8.ctypes.data)
        if self._w[_W_MAGIC] != _MAGIC or self._w[_W_VERSION] != _VERSION or self._w[_W_NRANKS] != self.size:
            self._release_views()
            raise TransportError("shared-memory segment has a foreign or corrupt header; is another job using it?")
        self.capacity = int(self._w[_W_CAPACITY])
        self.small_bytes = min(small_bytes, self.capacity)
        self._data0 = _segment_bytes(self.size, 0)
        self._stride = self.capacity + _result_bytes(self.size, self.capacity)
        self._line = [(_HEADER + q * _LINE) // 8 for q in range(self.size)]
        d0 = _descriptors_offset(self.size)
        self._desc_at = [(d0 + 2 * q * DESCRIPTOR_BYTES, d0 + (2 * q + 1) * DESCRIPTOR_BYTES) for q in range(self.size)]
        self._me = self._line[self.index]
        self._others = [q for q in range(self.size) if q != self.index]
        self._sleep_words = [self._line[q] + _C_SLEEP for q in range(self.size)]
        # Every member wrote its pid before creation finished. Peers in this very process are threads: a spinning
        # thread holds the GIL that the peer needs to make progress, so they sleep on the futex at once.
        if any(self._w[self._line[q] + _C_PID] == os.getpid() for q in self._others):
            self._spin = self._spin_now = self._spin_max = 0.0

    # -- construction ------------------------------------------------------------------------------------------

    @staticmethod
    def supported() -> bool:
        """True where the shared-memory path is correct: x86-64 (see the module notes on memory ordering)."""
        return platform.machine().lower() in ("x86_64", "amd64")

    @classmethod
    def create(
        cls,
        transport: Transport,
        *,
        ranks: Sequence[int],
        run_id: str,
        timeout: float,
        tag: int,
        capacity: int = DEFAULT_CAPACITY,
        small_bytes: int = DEFAULT_SMALL_BYTES,
        spin: float = DEFAULT_SPIN_S,
        spin_max: float = DEFAULT_SPIN_MAX_S,
    ) -> ShmGroup:
        """Creates the group collectively: every rank in ``ranks`` calls this with the same arguments.

        The lowest rank creates the segment ``paratrain-{run_id}-shm-*`` in ``/dev/shm`` and sends its name to the
        others with ``tag``; each maps it and confirms; the creator then unlinks the name, so nothing is left on
        disk even if a process crashes later (until then the launcher's sweep removes the prefix). Blocks.

        Args:
            transport: this rank's transport (used only during creation, and to learn of lost peers).
            ranks: the members, all on this host; this rank must be one of them.
            run_id: the job's id (``ctx.settings.run_id``), part of the segment name.
            timeout: seconds for creation, and the default timeout of every collective.
            tag: a tag for the creation messages, the same on all members (``ctx.next_collective_tag()``).
            capacity: bytes per pipeline block (memory used: ``2 * capacity`` per rank); the creator's value wins.
            small_bytes: arrays up to this size use the one-phase path (see the module notes).
            spin: seconds to spin before sleeping while waiting for a peer (0 sleeps at once). Spinning costs a
                core while a peer is late; sleeping costs a wake-up (~40 µs bare metal, up to ~500 µs in a busy VM).
            spin_max: how far the spin may grow when waits keep ending just after the spin ran out (see
                ``_adapt_spin``); set it equal to ``spin`` to keep the spin fixed.

        Raises:
            ConfigError: bad arguments, or an architecture where the path is unsupported.
            PeerLostError, CommTimeoutError: a member died or did not answer in time.
            TransportError: the segment could not be created or mapped on some member.
        """
        members = sorted(set(ranks))
        if transport.rank not in members:
            raise ConfigError(f"rank {transport.rank} is not among the group's ranks {members}")
        if len(members) != len(ranks):
            raise ConfigError(f"ranks {list(ranks)} contain duplicates")
        if capacity < 4096 or capacity % 4096:
            raise ConfigError(f"capacity must be a positive multiple of 4096 bytes, got {capacity}")
        if capacity < 64 * len(members):
            raise ConfigError(f"capacity {capacity} is too small for {len(members)} ranks (need 64 bytes each)")
        if small_bytes < 0 or spin < 0 or spin_max < 0 or timeout <= 0:
            raise ConfigError("small_bytes, spin and spin_max must be >= 0 and timeout > 0")
        if not cls.supported():
            raise ConfigError(
                f"the shared-memory collectives need x86-64 memory ordering; this is {platform.machine()}. "
                "Use algorithm='ring' or 'tree'."
            )
        if len(members) == 1:
            return cls(transport=transport, ranks=members, mm=None, timeout=timeout, spin=spin, small_bytes=0)
        deadline = time.monotonic() + timeout
        if transport.rank == members[0]:
            mm = _create_as_leader(transport, members, run_id=run_id, capacity=capacity, tag=tag, deadline=deadline)
        else:
            mm = _join_as_member(transport, members[0], members.index(transport.rank), tag, deadline)
        try:
            group = cls(
                transport=transport,
                ranks=members,
                mm=mm,
                timeout=timeout,
                spin=spin,
                small_bytes=small_bytes,
                spin_max=spin_max,
            )
        except BaseException:
            mm.close()
            raise
        return group

    @classmethod
    def from_context(cls, ctx: Context, *, capacity: int = DEFAULT_CAPACITY, **kwargs: Any) -> ShmGroup:
        """Creates the group of all ranks of ``ctx``, which must all run on this host. Collective; blocks.

        Raises:
            ConfigError: the job spans several hosts (build the group from the ranks of one host with
                :meth:`create` instead).
        """
        if ctx.local_world_size != ctx.world_size:
            raise ConfigError(
                f"only {ctx.local_world_size} of {ctx.world_size} ranks are on this host; create a ShmGroup per "
                "host with ShmGroup.create(ranks=...)"
            )
        return cls.create(
            ctx.transport,
            ranks=list(range(ctx.world_size)),
            run_id=ctx.settings.run_id,
            timeout=ctx.settings.timeout,
            tag=ctx.next_collective_tag(),
            capacity=capacity,
            **kwargs,
        )

    def close(self) -> None:
        """Leaves the group and unmaps the segment (freed when the last member closes). Idempotent.

        Peers still inside a collective that waits for this rank fail with ``PeerLostError`` at once.
        """
        if self._closed:
            return
        self._closed = True
        if self._mm is None:
            return
        self._w[self._me + _C_LEFT] = 1
        self._wake_all()
        self._release_views()

    def _release_views(self) -> None:
        mm, self._mm = self._mm, None
        self._plans.clear()
        self._w.release()
        del self._u8
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:  # a view is still referenced, e.g. by the frames of a caught exception's traceback
            gc.collect()
            try:
                mm.close()
            except BufferError:
                log.debug("shared-memory segment still referenced; it is unmapped when the last view is freed")

    def __enter__(self) -> ShmGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        self._enter()
        try:
            self._check_collective()
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            try:
                flat, name = self._check_array(arr, dtype_name)
                red = self._reducer(op, name)
                if signature is None:
                    desc = self._own_descriptor("allreduce", op, name, arr.shape, None)
                else:
                    desc = self._descriptor(signature, name, flat.size)
            except (ValueError, TypeError) as exc:
                self._reject(exc, deadline)
            if self._mm is None:
                return
            if flat.size == 0:
                self._agree(desc, deadline)
            elif flat.nbytes <= self.small_bytes:
                self._allreduce_small(flat, red, desc, deadline)
            else:
                self._allreduce_blocks(flat, red, desc, deadline)
        except _SettledError as settled:
            raise settled.error from None
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._lock.release()

    def broadcast_(
        self, arr: _Array, root: int, *, timeout: float | None = None, signature: Signature | None = None
    ) -> None:
        """Copies ``arr`` of rank ``root`` (a transport rank in ``ranks``) into ``arr`` of every rank. Blocks.

        Raises:
            CollectiveMismatchError: ranks passed different shapes, dtypes or roots (on every rank; the group
                stays usable).
            ValueError, TypeError, PeerLostError, CommTimeoutError: as for :meth:`allreduce_`.
        """
        self._enter()
        try:
            self._check_collective()
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            try:
                if root not in self.ranks:
                    raise ValueError(f"root {root} is not a member of the group {list(self.ranks)}")
                flat, name = self._check_array(arr, None)
                if signature is None:
                    desc = self._own_descriptor("broadcast", None, name, arr.shape, root)
                else:
                    desc = self._descriptor(signature, name, flat.size)
            except (ValueError, TypeError) as exc:
                self._reject(exc, deadline)
            if self._mm is None:
                return
            if flat.size == 0:
                self._agree(desc, deadline)
            else:
                self._broadcast(flat, self.ranks.index(root), desc, deadline)
        except _SettledError as settled:
            raise settled.error from None
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._lock.release()

    def barrier(self, *, timeout: float | None = None) -> None:
        """Blocks until every member has entered the barrier (one counter store and one wait).

        Raises:
            CollectiveMismatchError: a member called another collective instead (on every rank; the group stays
                usable).
            PeerLostError, CommTimeoutError: as for :meth:`allreduce_`.
        """
        self.agree(_BARRIER, timeout=timeout)

    def agree(self, signature: Signature, *, timeout: float | None = None) -> list[Signature]:
        """The agreement step alone: every member's signature, in member order, once all have arrived. Blocks.

        A barrier that also compares the calls: the collectives API runs it before the socket algorithms of a
        host whose ranks share this group (a few microseconds, instead of log2 N socket round trips).

        Returns:
            ``signature`` of every member (``[signature] * size`` when all are equal; the decoded descriptors when
            they differ only where :func:`~paratrain.collectives.signature.mismatch` allows, e.g. the first
            dimension of an allgather).

        Raises:
            CollectiveMismatchError: the signatures differ (on every member; the group stays usable).
            PeerLostError, CommTimeoutError: as for :meth:`allreduce_`.
        """
        self._enter()
        try:
            self._check_collective()
            if self._mm is None:
                return [signature]
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            try:
                desc = self._descriptor(signature)
            except (ValueError, TypeError) as exc:
                self._reject(exc, deadline)
            return self._agree(desc, deadline) or [signature] * self.size
        except _SettledError as settled:
            raise settled.error from None
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._lock.release()

    # -- neighbour exchange (gossip) ---------------------------------------------------------------------------

    def publish(self, arr: _Array | Sequence[_Array]) -> None:
        """Posts ``arr`` for this rank's graph neighbours (exchange number k, counting from 0). Never waits.

        A sequence of arrays is laid out back to back, as their concatenated bytes (without a concatenated copy).

        A neighbour exchange is not a collective: each rank reads only the peers it names in :meth:`peer_array`,
        and nobody waits for anyone else, so a slow rank delays its neighbours only. Every member publishes once
        per exchange, in the same sequence, and the array goes to slot ``k % 2`` of this rank. Why two slots are
        enough: a rank overwrites slot ``k % 2`` at exchange ``k + 2``, after reading its neighbours' exchange
        ``k + 1``, which each neighbour publishes only after it has read this rank's exchange ``k``. That holds
        when neighbourhoods are symmetric (a rank reads its readers) and each rank finishes with the views of
        exchange ``k`` before it publishes ``k + 1`` — exactly D-PSGD's step. A group used for exchanges must
        not run collectives (their counters mean something else): use a group of its own.

        Raises:
            ValueError: ``arr`` is larger than the group's ``capacity``.
            RuntimeError: the group already ran collectives.
        """
        self._enter()
        try:
            self._check_usable()
            if self._k:
                raise RuntimeError("this ShmGroup runs collectives; neighbour exchanges need a group of their own")
            if self._mm is None:
                return
            parts = [arr] if isinstance(arr, np.ndarray) else list(arr)
            flats = [np.ascontiguousarray(part).reshape(-1).view(np.uint8) for part in parts]
            nbytes = sum(flat.nbytes for flat in flats)
            if nbytes > self.capacity:
                raise ValueError(f"{nbytes} bytes do not fit the group's capacity of {self.capacity} bytes")
            k = self._x
            start = self._slot_offset(self.index, k & 1)
            for flat in flats:
                self._u8[start : start + flat.nbytes] = flat
                start += flat.nbytes
            self._describe(k, self._own_descriptor("exchange", None, "uint8", (nbytes,), None))
            self._x = k + 1
            self._signal(k + 1)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._lock.release()

    def peer_array(self, peer: int, dtype: npt.DTypeLike, count: int, *, timeout: float | None = None) -> _Array:
        """What ``peer`` (a transport rank of the group) published in this rank's latest exchange. Blocks.

        Returns a view into shared memory of ``count`` items of ``dtype``, valid until this rank's next
        :meth:`publish` (see there why); copy it to keep it longer.

        Raises:
            CollectiveMismatchError: ``peer`` published a different number of bytes.
            PeerLostError: ``peer`` died, left the group, or failed.
            CommTimeoutError: ``peer`` did not publish within the timeout.
        """
        self._check_usable()
        if peer not in self.ranks or peer == self.rank:  # a wrong argument: the group stays usable
            raise ValueError(f"peer {peer} is not another member of the group {list(self.ranks)}")
        if self._x == 0:
            raise RuntimeError("peer_array() before publish(): publish this rank's exchange first")
        self._enter()
        try:
            k = self._x - 1
            dt = np.dtype(dtype)
            nbytes = count * dt.itemsize
            q = self.ranks.index(peer)
            if self._mm is None:  # pragma: no cover - a one-member group has no peers
                raise ValueError("a one-member group has no peers")
            word = self._line[q]
            if self._w[word] < k + 1:
                self._wait_one(q, word, k + 1, time.monotonic() + (self.timeout if timeout is None else timeout))
            expected = self._own_descriptor("exchange", None, "uint8", (nbytes,), None)
            at = self._desc_at[q][k & 1]
            if self._seg[at : at + len(expected)] != expected:
                theirs = Signature.decode(self._seg[at : at + DESCRIPTOR_BYTES])
                what = f"{theirs.shape[0]} bytes" if theirs.kind == "exchange" and theirs.shape else theirs.kind
                raise CollectiveMismatchError(
                    f"rank {self.rank} expected {nbytes} bytes from rank {peer} in neighbour exchange {k}, but it "
                    f"published {what}; every rank must build the same model"
                )
            start = self._slot_offset(q, k & 1)
            return self._u8[start : start + nbytes].view(dt)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._lock.release()

    # -- the algorithms ----------------------------------------------------------------------------------------

    def _allreduce_small(self, flat: _Array, red: Reducer, desc: bytes, deadline: float) -> None:
        k = self._k
        pos = k & 1
        plan = self._plan(flat.dtype, flat.size)
        slots = plan.whole[pos]
        np.copyto(slots[self.index], flat)
        self._describe(k, desc)
        self._signal(2 * k + 1)
        self._wait_all(2 * k + 1, deadline)
        self._check_descriptors(k, desc)
        self._k = k + 1
        red.combine(slots[0], slots[1], flat)  # in rank order on every rank: bitwise equal results
        for q in range(2, self.size):
            red.combine(flat, slots[q], flat)
        red.finish(flat, self.size)

    def _allreduce_blocks(self, flat: _Array, red: Reducer, desc: bytes, deadline: float) -> None:
        me, size = self.index, self.size
        per_block = self._block_elems(flat.dtype, parts=size)
        total = flat.size
        starts = range(0, total, per_block)
        k0 = self._k
        last = len(starts) - 1
        self._copy_in(flat, 0, min(per_block, total), k0, desc)
        for i, start in enumerate(starts):
            k = k0 + i
            n = min(per_block, total - start)
            plan = self._plan(flat.dtype, n)
            pos = k & 1
            self._wait_all(2 * k + 1, deadline)
            if i == 0:
                self._check_descriptors(k, desc)
            lo, hi = plan.bounds[me]
            if hi > lo:
                mine = flat[start + lo : start + hi]
                self._reduce_part(mine, plan.peer_mine[pos], red)
                np.copyto(plan.own[pos], mine)
            self._signal(2 * k + 2)
            if i < last:
                nxt = start + per_block
                self._copy_in(flat, nxt, min(per_block, total - nxt), k + 1, None)
            self._wait_all(2 * k + 2, deadline)
            for src, qlo, qhi in plan.peer_own[pos]:
                np.copyto(flat[start + qlo : start + qhi], src)
        self._k = k0 + last + 1

    def _copy_in(self, flat: _Array, start: int, n: int, k: int, desc: bytes | None) -> None:
        """``in(k)``: copies the parts of block ``k`` that peers reduce into my slot (and the call's descriptor, for
        its first block), then signals."""
        plan = self._plan(flat.dtype, n)
        slot = plan.whole[k & 1][self.index]
        lo, hi = plan.bounds[self.index]
        if lo > 0:
            np.copyto(slot[:lo], flat[start : start + lo])
        if hi < n:
            np.copyto(slot[hi:], flat[start + hi : start + n])
        if desc is not None:
            self._describe(k, desc)
        self._signal(2 * k + 1)

    def _reduce_part(self, mine: _Array, sources: Sequence[_Array], red: Reducer) -> None:
        for src in sources:
            red.combine(mine, src, mine)
        red.finish(mine, self.size)

    def _broadcast(self, flat: _Array, root: int, desc: bytes, deadline: float) -> None:
        per_block = self._block_elems(flat.dtype, parts=1)
        k0 = self._k
        for i, start in enumerate(range(0, flat.size, per_block)):
            k = k0 + i
            n = min(per_block, flat.size - start)
            slots = self._plan(flat.dtype, n).whole[k & 1]
            if self.index == root:
                np.copyto(slots[root], flat[start : start + n])
            if i == 0:
                self._describe(k, desc)
            self._signal(2 * k + 1)
            self._wait_all(2 * k + 1, deadline)
            if i == 0:
                self._check_descriptors(k, desc)
            if self.index != root:
                np.copyto(flat[start : start + n], slots[root])
            self._k = k + 1

    # -- layout helpers ----------------------------------------------------------------------------------------

    def _block_elems(self, dtype: np.dtype[Any], *, parts: int) -> int:
        """Elements per block: as many as fit, a multiple of ``parts`` cache-line-aligned pieces."""
        align = max(1, _ALIGN // dtype.itemsize)
        unit = parts * align
        return max(unit, self.capacity // dtype.itemsize // unit * unit)

    def _plan(self, dtype: np.dtype[Any], n: int) -> _Plan:
        key = (dtype, n)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        size, me = self.size, self.index
        align = max(1, _ALIGN // dtype.itemsize)
        per = -(-n // size)
        per = -(-per // align) * align
        bounds = tuple((min(q * per, n), min((q + 1) * per, n)) for q in range(size))
        whole = tuple(
            tuple(
                self._u8[self._slot_offset(q, pos) : self._slot_offset(q, pos) + n * dtype.itemsize].view(dtype)
                for q in range(size)
            )
            for pos in (0, 1)
        )
        lo, hi = bounds[me]
        own = tuple(self._result(me, pos, dtype, hi - lo) for pos in (0, 1))
        peer_own = tuple(
            tuple(
                (self._result(q, pos, dtype, bounds[q][1] - bounds[q][0]), *bounds[q])
                for q in self._others
                if bounds[q][1] > bounds[q][0]
            )
            for pos in (0, 1)
        )
        peer_mine = tuple(tuple(whole[pos][q][lo:hi] for q in self._others) for pos in (0, 1))
        plan = _Plan(n=n, bounds=bounds, whole=whole, own=own, peer_own=peer_own, peer_mine=peer_mine)
        self._plans[key] = plan
        if len(self._plans) > _PLAN_CACHE:
            self._plans.popitem(last=False)
        return plan

    def _slot_offset(self, q: int, pos: int) -> int:
        return self._data0 + (q * 2 + pos) * self._stride

    def _result(self, q: int, pos: int, dtype: np.dtype[Any], n: int) -> _Array:
        """The result area of slot ``(q, pos)``: separate from the inputs, because a peer may still copy out my
        result of block ``k - 2`` while I already copy block ``k``'s inputs in (whose parts may lie anywhere
        when the block length changes)."""
        start = self._slot_offset(q, pos) + self.capacity
        return self._u8[start : start + n * dtype.itemsize].view(dtype)

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError("this ShmGroup was closed; create a new one")
        if self._broken is not None:
            raise TransportError(f"this ShmGroup is broken by an earlier error ({self._broken}); close it")

    def _check_collective(self) -> None:
        self._check_usable()
        if self._x:
            raise RuntimeError("this ShmGroup carries neighbour exchanges; collectives need a group of their own")

    def _check_array(self, arr: _Array, dtype_name: str | None) -> tuple[_Array, str]:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"ShmGroup collectives take numpy arrays, got {type(arr).__name__}")
        flags = arr.flags
        if not flags.c_contiguous or not flags.writeable:
            raise ValueError("the array must be C-contiguous and writeable (it is updated in place)")
        name = _NAMES.get(arr.dtype)
        if name is None:
            name = _NAMES[arr.dtype] = _wire_dtype_name(arr.dtype)
        if dtype_name is not None and dtype_name != name:
            if not (dtype_name == "bfloat16" and name == "uint16"):
                raise TypeError(f"dtype_name {dtype_name!r} does not describe an array of dtype {arr.dtype}")
            name = dtype_name
        return (arr if arr.ndim == 1 else arr.reshape(-1)), name

    def _reducer(self, op: str, name: str) -> Reducer:
        red = self._reducers.get((op, name))
        if red is None:
            red = self._reducers[(op, name)] = Reducer(op, name)
        return red

    # -- synchronisation ---------------------------------------------------------------------------------------

    def _enter(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("ShmGroup used from two threads at once; one thread per rank must drive a group")

    def _fail(self, exc: BaseException) -> None:
        """Marks the group broken and wakes every peer with the abort word, so that nobody waits for us."""
        if self._broken is None and not self._closed:
            self._broken = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, PeerLostError) and exc.peer in self.ranks and exc.peer != self.rank:
            # pass on who was lost, not who noticed: the others should name the root cause
            self._abort(_WHY_LOST, lost=self.ranks.index(exc.peer))
        else:
            self._abort(_WHY_MISMATCH if isinstance(exc, CollectiveMismatchError) else _WHY_ERROR)

    def _descriptor(self, signature: Signature, dtype: str = "", size: int = -1) -> bytes:
        """``signature`` encoded (cached: encoding costs ~1 µs, a lookup ~0.1 µs).

        Raises:
            ValueError: with ``dtype``: ``signature`` does not describe an array of ``size`` items of ``dtype``.
        """
        if dtype and (signature.dtype != dtype or math.prod(signature.shape) != size):
            raise ValueError(f"signature {signature} does not describe the array ({size} items of {dtype})")
        desc = self._descs.get(signature)
        if desc is None:
            desc = self._cache_descriptor(signature, signature)
        return desc

    def _own_descriptor(self, kind: str, op: str | None, dtype: str, shape: tuple[int, ...], root: int | None) -> bytes:
        """The encoded signature of this group's own call (algorithm ``"shm"``); cached by a cheaper key."""
        key = (kind, op, dtype, shape, root)
        desc = self._descs.get(key)
        if desc is None:
            desc = self._cache_descriptor(key, Signature(kind, op, dtype, shape, ALGORITHM, ALGORITHM, root))
        return desc

    def _cache_descriptor(self, key: tuple[Any, ...], signature: Signature) -> bytes:
        if len(self._descs) >= _DESC_CACHE:
            self._descs.clear()
        desc = self._descs[key] = signature.encode()
        return desc

    def _describe(self, k: int, desc: bytes) -> None:
        """Writes my descriptor of block ``k`` (before the counter store that publishes the block)."""
        at = self._desc_at[self.index][k & 1]
        self._seg[at : at + len(desc)] = desc

    def _agree(self, desc: bytes, deadline: float) -> list[Signature] | None:
        """An agreement step without data: see :meth:`_check_descriptors` for what it returns and raises."""
        k = self._k
        self._describe(k, desc)
        self._signal(2 * k + 1)
        self._wait_all(2 * k + 1, deadline)
        sigs = self._check_descriptors(k, desc)
        self._k = k + 1
        return sigs

    def _reject(self, error: ValueError | TypeError, deadline: float) -> NoReturn:
        """This rank's arguments are invalid: it takes part in the agreement step with the "invalid" signature,
        so that the peers raise ``CollectiveMismatchError`` at once instead of waiting for it, then raises
        ``error`` (as :class:`_SettledError`: the group stays usable). Called inside the handler of ``error``."""
        if self._mm is not None:
            k = self._k
            self._describe(k, self._descriptor(INVALID))
            self._signal(2 * k + 1)
            self._wait_all(2 * k + 1, deadline)
            self._k = k + 1
        raise _SettledError(error)

    def _signal(self, value: int) -> None:
        """Publishes my counter; wakes sleepers if any may be asleep.

        The lock round trip is a full fence on x86 (a locked instruction): without it my counter store could
        still sit in the store buffer while I read the sleep flags as 0, and a waiter that set its flag and
        read my old counter would sleep through a whole slice (a lost wake-up)."""
        w = self._w
        w[self._me] = value
        with self._fence_lock:
            pass
        for word in self._sleep_words:
            if w[word]:
                futex.wake(self._addr + self._me * 8)
                return

    def _wait_all(self, value: int, deadline: float) -> None:
        w = self._w
        for q in self._others:
            word = self._line[q]
            if w[word] < value:
                self._wait_one(q, word, value, deadline)
        if w[_W_ABORT]:
            self._raise_aborted()

    def _wait_one(self, q: int, word: int, value: int, deadline: float) -> None:
        w = self._w
        perf = time.perf_counter
        start = perf()
        spin_end = start + self._spin_now
        yield_ = self._yield
        while True:
            if w[word] >= value:
                return
            if w[_W_ABORT]:
                self._raise_aborted()
            if yield_:
                os.sched_yield()
            if perf() >= spin_end:
                break
        sleep_word = self._me + _C_SLEEP
        while True:
            w[sleep_word] = q + 1
            seen = w[word]
            if seen < value:
                futex.wait(self._addr + word * 8, seen, SLICE_S)
            w[sleep_word] = 0
            if w[word] >= value:
                self._adapt_spin(perf() - start)
                return
            self._check_peer(q, value, deadline)

    def _adapt_spin(self, waited: float) -> None:
        """After a wait that had to sleep: spin longer next time if spinning a little longer would have caught it.

        Why: a sleeping peer wakes only after the kernel (and, in a VM, the hypervisor) reschedules it, ~50-500 µs.
        Once one rank sleeps, its peer then waits that long too, overruns its own spin and sleeps as well: the pair
        can stay in this slow regime for good. Spinning past the wake-up latency breaks the cycle. Waits longer
        than ``spin_max`` are real delays (a straggler, compute between calls); spinning there only burns a core,
        so the spin shrinks back towards ``spin``.
        """
        if waited < self._spin_max:
            self._spin_now = min(self._spin_max, max(2 * self._spin_now, 1.5 * waited))
        else:
            self._spin_now = max(self._spin, self._spin_now / 2)

    def _check_peer(self, q: int, value: int, deadline: float) -> None:
        """Between futex slices: raise if the group was aborted, ``q`` left or died, or time ran out."""
        w = self._w
        if w[_W_ABORT]:
            self._raise_aborted()
        peer = self.ranks[q]
        if w[self._line[q] + _C_LEFT]:
            raise PeerLostError(f"rank {peer} closed its shared-memory group while rank {self.rank} waited", peer=peer)
        if peer in self._transport.lost_peers():
            raise PeerLostError(f"rank {peer} was lost during a shared-memory collective", peer=peer)
        pid = int(w[self._line[q] + _C_PID])
        if pid and pid != os.getpid() and _process_dead(pid):
            raise PeerLostError(f"rank {peer} (pid {pid}) died during a shared-memory collective", peer=peer)
        if time.monotonic() >= deadline:
            raise CommTimeoutError(
                f"rank {self.rank}: rank {peer} did not reach step {value} of the shared-memory collective in time; "
                "it may be slow, stuck, or calling another collective — raise the timeout or check that rank"
            )

    def _check_descriptors(self, k: int, desc: bytes) -> list[Signature] | None:
        """The agreement of block ``k``, once every member has published it: None if every descriptor equals
        mine (a byte compare per peer), else every member's decoded signature if they differ only where that is
        allowed.

        Raises:
            _SettledError: with the ``CollectiveMismatchError`` that every member raises (they all compute it from the
                same descriptors), after moving past block ``k`` like every other member: nobody reads any peer's
                data of this call, and all leave at the same step, so the group stays usable.
        """
        seg, pos, n = self._seg, k & 1, len(desc)
        for q in self._others:
            at = self._desc_at[q][pos]
            if seg[at : at + n] != desc:
                break
        else:
            return None
        sigs = [Signature.decode(seg[at[pos] : at[pos] + DESCRIPTOR_BYTES]) for at in self._desc_at]
        error = mismatch_error(sigs)
        if error is not None:
            self._k = k + 1
            raise _SettledError(error)
        return sigs

    def _abort(self, why: int, lost: int | None = None) -> None:
        if self._mm is None or self._closed:
            return
        if not self._w[_W_ABORT]:
            self._w[_W_ABORT_WHY] = why
            self._w[_W_ABORT_LOST] = 0 if lost is None else lost + 1
            self._w[_W_ABORT] = self.index + 1  # last: a reader that sees it sees the words above (x86 TSO)
        self._wake_all()

    def _wake_all(self) -> None:
        with self._fence_lock:
            pass
        for q in range(self.size):
            futex.wake(self._addr + self._line[q] * 8)

    def _raise_aborted(self) -> None:
        who = int(self._w[_W_ABORT]) - 1
        peer = self.ranks[who] if 0 <= who < self.size else -1
        if int(self._w[_W_ABORT_WHY]) == _WHY_MISMATCH:
            raise CollectiveMismatchError(
                f"rank {peer} found that its neighbours published different sizes (see its error); every rank must "
                "publish the same layout"
            )
        lost = int(self._w[_W_ABORT_LOST]) - 1
        if int(self._w[_W_ABORT_WHY]) == _WHY_LOST and 0 <= lost < self.size and lost != self.index:
            gone = self.ranks[lost]
            raise PeerLostError(
                f"rank {gone} was lost (rank {peer} saw it first and stopped the shared-memory group)", peer=gone
            )
        raise PeerLostError(f"rank {peer} failed inside a shared-memory collective; see its error", peer=peer)


class _SettledError(Exception):
    """Carries an error that every member accounted for in the agreement step (a mismatch, or arguments one member
    rejected): the public method raises ``error`` without breaking the group."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# -- collective creation of the segment -----------------------------------------------------------------------


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def _create_as_leader(
    transport: Transport, members: list[int], *, run_id: str, capacity: int, tag: int, deadline: float
) -> mmap.mmap:
    size = _segment_bytes(len(members), capacity)
    name = f"paratrain-{run_id}-shm-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(_segment_dir(), name)
    others = members[1:]
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        for q in others:
            transport.send(q, tag, meta={"error": f"creating {path} failed: {exc}"}, timeout=_remaining(deadline))
        raise TransportError(f"cannot create the shared-memory segment {path}: {exc}") from None
    errors: list[str] = []
    mm: mmap.mmap | None = None
    try:
        try:
            os.ftruncate(fd, size)
            mm = _map(fd, size)
        finally:
            os.close(fd)
        words = memoryview(mm).cast("Q")
        words[_W_CAPACITY], words[_W_NRANKS], words[_W_VERSION] = capacity, len(members), _VERSION
        words[_W_MAGIC] = _MAGIC
        words.release()
        _write_pid(mm, 0)
        for q in others:
            transport.send(q, tag, meta={"path": path, "size": size}, timeout=_remaining(deadline))
        for q in others:
            reply = transport.recv(q, tag, timeout=_remaining(deadline))
            if "error" in reply.meta:
                errors.append(f"rank {q}: {reply.meta['error']}")
    except BaseException:
        if mm is not None:
            mm.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for q in others:
        transport.send(q, tag, meta={"ok": not errors}, timeout=_remaining(deadline))
    if errors:
        mm.close()
        raise TransportError("shared-memory group creation failed: " + "; ".join(errors))
    return mm


def _write_pid(mm: mmap.mmap, index: int) -> None:
    words = memoryview(mm).cast("Q")
    words[(_HEADER + index * _LINE) // 8 + _C_PID] = os.getpid()
    words.release()


def _join_as_member(transport: Transport, leader: int, index: int, tag: int, deadline: float) -> mmap.mmap:
    offer = transport.recv(leader, tag, timeout=_remaining(deadline))
    if "error" in offer.meta:
        raise TransportError(f"rank {leader} could not create the shared-memory segment: {offer.meta['error']}")
    path, size = str(offer.meta["path"]), int(offer.meta["size"])
    mm: mmap.mmap | None = None
    error = None
    if os.path.basename(path).startswith("paratrain-") and os.path.dirname(path) == _segment_dir():
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                if os.fstat(fd).st_size != size:
                    raise OSError(f"size {os.fstat(fd).st_size} != {size}")
                mm = _map(fd, size)
            finally:
                os.close(fd)
            _write_pid(mm, index)
        except OSError as exc:
            error = f"mapping {path} failed: {exc}"
    else:
        error = f"refusing segment path {path!r} outside {_segment_dir()}"
    transport.send(leader, tag, meta={"error": error} if error else {"ok": True}, timeout=_remaining(deadline))
    verdict = transport.recv(leader, tag, timeout=_remaining(deadline))
    if error or not verdict.meta.get("ok"):
        if mm is not None:
            mm.close()
        raise TransportError(error or "shared-memory group creation failed on another rank; see its error")
    assert mm is not None
    return mm


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
