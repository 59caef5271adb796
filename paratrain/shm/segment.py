"""A shared-memory segment of the ranks of one host: its counters to wait on, liveness checks, and abort.

Why: between processes of one host, TCP or ipc sockets copy every byte twice through the kernel and wake the
receiver through the scheduler (~40 µs per hop here). A segment mapped by every rank needs one copy in and one
copy out, and a waiter that spins on its peers' counters sees their progress within a cache-line transfer.
This is how MPI's shared-memory transports beat sockets inside a host.

This module holds what every protocol on a segment shares; what a counter value, a slot or a descriptor means
is the protocol's: the collectives (:class:`~paratrain.collectives.shm.ShmGroup`) or gossip's neighbour
exchange (:class:`~paratrain.gossip.shm.ShmExchangeGroup`). A segment carries one protocol, never both
(:meth:`Segment.claim`): their counters count different things.

Signalling, waiting, the liveness checks and the abort word are one protocol on the same control lines (a
waiter's sleep, a signaller's wake-up and a dying rank's abort agree on every word); the file's creation and
mapping live in :mod:`.mapping`.

The memory: a header, one control line per rank (counter | sleeping-on | pid | left), two descriptors and
two slots per rank, for alternate steps (see :mod:`paratrain.shm.mapping`, which also creates and maps it).

Memory ordering: this relies on x86-64's total store order: the data stores of a copy become visible before
the counter store that follows them, and a reader's data loads are not performed before its counter load.
CPython makes both opaque C calls (numpy copies, ``memoryview`` stores), so the compiler cannot reorder them
either. The one reordering x86 does allow, a store passing a later load, matters only between a counter store
and the check for sleeping waiters; a locked instruction (a lock round trip) fences it, see
:meth:`Segment.signal`. Weaker architectures (ARM, POWER) would need explicit fences that Python does not offer,
so :meth:`Segment.supported` is False there and callers must choose another path.

Waiting: spin on the peer's counter for ``spin`` seconds (``sched_yield`` in the loop when there are more
ranks than cores, so the spinner gives its core to the rank it waits for; the spin adapts up to ``spin_max``
when waits keep ending just after it, see ``Segment._adapt_spin``), then sleep on the counter with a futex
(see :mod:`paratrain.shm.futex`) in slices of :data:`SLICE_S`, checking between slices for an aborted
segment, a peer that left or died, and the deadline. A rank that fails sets the abort word and wakes everyone
(:meth:`Segment.fail`), so no peer hangs. Members that are threads of one process never spin: the spinner
would hold the GIL that its peer needs to make progress.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import platform
import threading
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from paratrain._process import process_dead
from paratrain.errors import CollectiveMismatchError, CommTimeoutError, ConfigError, PeerLostError, TransportError
from paratrain.shm import futex
from paratrain.shm.mapping import (
    CONTROL_LEFT,
    CONTROL_PID,
    CONTROL_SLEEP,
    HEADER,
    LINE,
    MAGIC,
    VERSION,
    W_ABORT,
    W_ABORT_LOST,
    W_ABORT_WHY,
    W_CAPACITY,
    W_DESCRIPTOR,
    W_EXTRA,
    W_MAGIC,
    W_NRANKS,
    W_VERSION,
    Layout,
    create_file,
    data_offset,
    descriptors_offset,
    join_file,
)
from paratrain.transport.base import Transport

__all__ = ["DEFAULT_SPIN_MAX_S", "DEFAULT_SPIN_S", "SLICE_S", "Segment"]

log = logging.getLogger("paratrain.shm.segment")

#: Seconds a waiter spins before sleeping on a futex. Waking a sleeping process costs ~40 µs on another core,
#: so spinning about as long keeps small collectives fast; longer spins waste a core while a peer is late.
DEFAULT_SPIN_S = 100e-6
#: Longest spin that adaptation may reach (see ``Segment._adapt_spin``). It must exceed the slowest wake-up of a
#: sleeping process, or ranks stay in the slow sleep/wake regime: on the 2-vCPU VM of the benchmarks, wake-ups
#: of over 1 ms happen, and 1 ms left ~1 run in 3 there (mean 4 KiB time 20-46 µs instead of 9); 5 ms did not.
#: (Yielding the core past the base spin was tried, and was slower: a yielding rank waits out the time slice of
#: whatever ran instead.)
DEFAULT_SPIN_MAX_S = 5e-3
#: Longest futex sleep; between slices a waiter checks for dead or departed peers, aborts and its deadline.
SLICE_S = 0.05

_WHY_ERROR, _WHY_MISMATCH, _WHY_LOST = 1, 2, 3  # values of the abort-why word

_Array = npt.NDArray[np.uint8]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Segment:
    """This rank's mapping of a segment shared by ranks of this host, and the counters they wait on in it.

    Create it collectively with :meth:`create`. A protocol then writes this rank's descriptors and slots,
    publishes them with :meth:`signal`, and waits for its peers' counters with :meth:`wait_all` or
    :meth:`wait_for`, which raise instead of hanging when a peer dies, leaves, fails, or exceeds the deadline.
    Not thread-safe: one thread per rank drives a segment, between :meth:`enter` and :meth:`leave`.

    Attributes:
        ranks: the member ranks (transport ranks), sorted.
        rank: this process's transport rank.
        index: this rank's position in ``ranks``.
        size: number of members.
        others: the positions of the other members.
        capacity: bytes of a slot's data area (0 for a one-member segment, which maps nothing).
        extra: bytes after the data area of each slot, for the protocol's own use.
        timeout: the protocol's default timeout (seconds).
        name: what error messages call the protocol object (``"ShmGroup"``).
        u8: the whole mapping as bytes, for the protocol's views (absent from a one-member segment).

    Example:
        >>> from paratrain.testing import run_ranks
        >>> def body(ctx):
        ...     seg = Segment.create(ctx.transport, ranks=[0, 1], run_id="doc", timeout=10,
        ...                          tag=ctx.next_collective_tag(), capacity=4096, descriptor_bytes=0)
        ...     seg.u8[seg.slot_offset(seg.index, 0)] = ctx.rank + 1   # my data, then my counter
        ...     seg.signal(1)
        ...     seg.wait_all(1, time.monotonic() + 10)
        ...     got = int(seg.u8[seg.slot_offset(1 - seg.index, 0)])
        ...     seg.close()
        ...     return got
        >>> run_ranks(2, body)
        [2, 1]
    """

    def __init__(
        self,
        *,
        transport: Transport,
        ranks: Sequence[int],
        mm: mmap.mmap | None,
        timeout: float,
        spin: float = DEFAULT_SPIN_S,
        spin_max: float = DEFAULT_SPIN_MAX_S,
        name: str = "shared-memory group",
    ) -> None:
        """Wraps an already mapped segment; use :meth:`create`, which maps it collectively."""
        self.ranks = tuple(ranks)
        self.rank = transport.rank
        self.index = self.ranks.index(self.rank)
        self.size = len(self.ranks)
        self.others = [q for q in range(self.size) if q != self.index]
        self.timeout = timeout
        self.name = name
        self._transport = transport
        self._spin = spin
        self._spin_max = max(spin, spin_max)
        self._spin_now = spin
        self._yield = self.size > _cpu_count()
        self._lock = threading.Lock()
        self._fence_lock = threading.Lock()
        self._broken: str | None = None  # the error text only: the exception's frames would pin views of the mmap
        self._closed = False
        self._use: str | None = None
        self._mm = mm
        if mm is None:
            self.capacity = self.extra = 0
            return
        self._seg = mm  # for byte slices of the descriptors (``_mm`` goes None on close)
        self.u8: _Array = np.frombuffer(mm, dtype=np.uint8)
        self._w: memoryview = memoryview(mm).cast("Q")
        self._addr = int(self.u8.ctypes.data)
        if self._w[W_MAGIC] != MAGIC or self._w[W_VERSION] != VERSION or self._w[W_NRANKS] != self.size:
            self._release_views()
            raise TransportError("shared-memory segment has a foreign or corrupt header; is another job using it?")
        self.capacity = int(self._w[W_CAPACITY])
        self.extra = int(self._w[W_EXTRA])
        desc = int(self._w[W_DESCRIPTOR])
        self._data0 = data_offset(self.size, desc)
        self._stride = self.capacity + self.extra
        self._line = [(HEADER + q * LINE) // 8 for q in range(self.size)]
        d0 = descriptors_offset(self.size)
        self._desc_at = [(d0 + 2 * q * desc, d0 + (2 * q + 1) * desc) for q in range(self.size)]
        self._described: list[bytes | None] = [None, None]  # what this rank last wrote at each position
        self._me = self._line[self.index]
        self._sleep_words = [self._line[q] + CONTROL_SLEEP for q in range(self.size)]
        # Every member wrote its pid before creation finished. Peers in this very process are threads: a spinning
        # thread holds the GIL that the peer needs to make progress, so they sleep on the futex at once.
        if any(self._w[self._line[q] + CONTROL_PID] == os.getpid() for q in self.others):
            self._spin = self._spin_now = self._spin_max = 0.0

    # -- construction ------------------------------------------------------------------------------------------

    @staticmethod
    def supported() -> bool:
        """True where the shared-memory path is correct: x86-64 (see the module notes on memory ordering)."""
        return platform.machine().lower() in ("x86_64", "amd64")

    @staticmethod
    def members(
        transport: Transport, ranks: Sequence[int], *, capacity: int, timeout: float, spin: float, spin_max: float
    ) -> list[int]:
        """The sorted members, once the arguments of :meth:`create` are checked (protocols check theirs after).

        Raises:
            ConfigError: this rank is not a member, a rank is listed twice, or a value is out of range.
        """
        members = sorted(set(ranks))
        if transport.rank not in members:
            raise ConfigError(f"rank {transport.rank} is not among the group's ranks {members}")
        if len(members) != len(ranks):
            raise ConfigError(f"ranks {list(ranks)} contain duplicates")
        if capacity < 4096 or capacity % 4096:
            raise ConfigError(f"capacity must be a positive multiple of 4096 bytes, got {capacity}")
        if spin < 0 or spin_max < 0 or timeout <= 0:
            raise ConfigError("spin and spin_max must be >= 0 and timeout > 0")
        return members

    @classmethod
    def create(
        cls,
        transport: Transport,
        *,
        ranks: Sequence[int],
        run_id: str,
        timeout: float,
        tag: int,
        capacity: int,
        descriptor_bytes: int,
        extra: int = 0,
        spin: float = DEFAULT_SPIN_S,
        spin_max: float = DEFAULT_SPIN_MAX_S,
        name: str = "shared-memory group",
    ) -> Segment:
        """Creates the segment collectively: every rank in ``ranks`` calls this with the same arguments.

        The lowest rank creates the file ``paratrain-{run_id}-shm-*`` in ``/dev/shm`` and sends its name to the
        others with ``tag``; each maps it and confirms; the creator then unlinks the name, so nothing is left on
        disk even if a process crashes later (until then the launcher's sweep removes the prefix). Blocks.

        Args:
            transport: this rank's transport (used only during creation, and to learn of lost peers).
            ranks: the members, all on this host; this rank must be one of them.
            run_id: the job's id (``ctx.settings.run_id``), part of the file name.
            timeout: seconds for creation, and the protocol's default timeout.
            tag: a tag for the creation messages, the same on all members (``ctx.next_collective_tag()``).
            capacity: bytes of each slot's data area (a multiple of 4096; memory used: ``2 * (capacity + extra)``
                per rank); the creator's value wins.
            descriptor_bytes: bytes of each descriptor (the protocol's longest encoding).
            extra: bytes after each slot's data area, for the protocol's own use.
            spin: seconds to spin before sleeping while waiting for a peer (0 sleeps at once). Spinning costs a
                core while a peer is late; sleeping costs a wake-up (~40 µs bare metal, up to ~500 µs in a busy VM).
            spin_max: how far the spin may grow when waits keep ending just after the spin ran out (see
                ``_adapt_spin``); set it equal to ``spin`` to keep the spin fixed.
            name: what error messages call the protocol object.

        Raises:
            ConfigError: bad arguments, or an architecture where shared memory is unsupported.
            PeerLostError, CommTimeoutError: a member died or did not answer in time.
            TransportError: the segment could not be created or mapped on some member.
        """
        members = cls.members(transport, ranks, capacity=capacity, timeout=timeout, spin=spin, spin_max=spin_max)
        if not cls.supported():
            raise ConfigError(f"shared memory between ranks needs x86-64 memory ordering; this is {platform.machine()}")
        if len(members) == 1:
            return cls(transport=transport, ranks=members, mm=None, timeout=timeout, spin=spin, name=name)
        deadline = time.monotonic() + timeout
        if transport.rank == members[0]:
            layout = Layout(capacity, extra, descriptor_bytes)
            mm = create_file(transport, members, run_id=run_id, layout=layout, tag=tag, deadline=deadline)
        else:
            mm = join_file(transport, members[0], members.index(transport.rank), tag, deadline)
        try:
            return cls(
                transport=transport, ranks=members, mm=mm, timeout=timeout, spin=spin, spin_max=spin_max, name=name
            )
        except BaseException:
            mm.close()
            raise

    @property
    def mapped(self) -> bool:
        """False for a one-member segment (nothing to share) and after :meth:`close`."""
        return self._mm is not None

    def close(self) -> None:
        """Leaves the segment and unmaps it (freed when the last member closes). Idempotent.

        Peers waiting for this rank's counter fail with ``PeerLostError`` at once. Views of the mapping that the
        caller still holds keep it mapped until they are freed.
        """
        if self._closed:
            return
        self._closed = True
        if self._mm is None:
            return
        self._w[self._me + CONTROL_LEFT] = 1
        self._wake_all()
        self._release_views()

    def _release_views(self) -> None:
        mm, self._mm = self._mm, None
        self._w.release()
        del self.u8
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

    # -- the memory ---------------------------------------------------------------------------------------------

    def slot_offset(self, q: int, pos: int) -> int:
        """Offset in :attr:`u8` of the slot of member ``q`` (a position in ``ranks``) at position ``pos``."""
        return self._data0 + (q * 2 + pos) * self._stride

    def describe(self, pos: int, desc: bytes) -> None:
        """Writes this rank's descriptor of position ``pos`` (before the counter store that publishes it)."""
        if self._described[pos] is desc:  # still there: only this rank writes it (a call's repeats share one object)
            return
        at = self._desc_at[self.index][pos]
        self._seg[at : at + len(desc)] = desc
        self._described[pos] = desc

    def descriptor(self, q: int, pos: int, nbytes: int) -> bytes:
        """The first ``nbytes`` of member ``q``'s descriptor of position ``pos``."""
        at = self._desc_at[q][pos]
        return self._seg[at : at + nbytes]

    # -- use ----------------------------------------------------------------------------------------------------

    def claim(self, use: str) -> None:
        """Dedicates the segment to ``use`` (``"collectives"``, ``"neighbour exchanges"``) on the first call.

        Raises:
            RuntimeError: the segment already carries another use (its counters would mean two things).
        """
        if self._use is None:
            self._use = use
        elif self._use != use:
            raise RuntimeError(f"this {self.name} carries {self._use}; {use} need a group of their own")

    def enter(self) -> None:
        """Starts a call of the protocol on this rank (see :meth:`leave`).

        Raises:
            RuntimeError: another thread is inside a call.
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{self.name} used from two threads at once; one thread per rank must drive a group")

    def leave(self) -> None:
        """Ends the call started by :meth:`enter`."""
        self._lock.release()

    def check_usable(self) -> None:
        """Raises ``TransportError`` if the segment was closed, or broken by an earlier :meth:`fail`."""
        if self._closed:
            raise TransportError(f"this {self.name} was closed; create a new one")
        if self._broken is not None:
            raise TransportError(f"this {self.name} is broken by an earlier error ({self._broken}); close it")

    def fail(self, exc: BaseException) -> None:
        """Marks the segment broken and wakes every peer with the abort word, so that nobody waits for us."""
        if self._broken is None and not self._closed:
            self._broken = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, PeerLostError) and exc.peer in self.ranks and exc.peer != self.rank:
            # pass on who was lost, not who noticed: the others should name the root cause
            self._abort(_WHY_LOST, lost=self.ranks.index(exc.peer))
        else:
            self._abort(_WHY_MISMATCH if isinstance(exc, CollectiveMismatchError) else _WHY_ERROR)

    # -- synchronisation ---------------------------------------------------------------------------------------

    def signal(self, value: int) -> None:
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

    def wait_all(self, value: int, deadline: float, *, spin: bool = True) -> None:
        """Blocks until every other member's counter is at least ``value``, then checks the abort word.
        ``spin=False``: sleep at once (a wait whose end this member is in no hurry for: its spinning would only
        take a core from the members that work meanwhile), without adapting the spin.

        Raises:
            PeerLostError: a peer died, left, or failed (it set the abort word).
            CommTimeoutError: ``deadline`` (``time.monotonic()``) passed first.
        """
        w = self._w
        for q in self.others:
            word = self._line[q]
            if w[word] < value:
                self._wait_one(q, word, value, deadline, spin=spin)
        if w[W_ABORT]:
            self._raise_aborted()

    def wait_for(self, q: int, value: int, deadline: float) -> None:
        """Blocks until member ``q``'s counter is at least ``value``; raises as :meth:`wait_all`."""
        word = self._line[q]
        if self._w[word] < value:
            self._wait_one(q, word, value, deadline)

    def _wait_one(self, q: int, word: int, value: int, deadline: float, *, spin: bool = True) -> None:
        w = self._w
        perf = time.perf_counter
        start = perf()
        spin_end = start + (self._spin_now if spin else 0.0)
        yield_ = self._yield
        while True:
            if w[word] >= value:
                return
            if w[W_ABORT]:
                self._raise_aborted()
            if yield_:
                os.sched_yield()
            if perf() >= spin_end:
                break
        sleep_word = self._me + CONTROL_SLEEP
        while True:
            w[sleep_word] = q + 1
            seen = w[word]
            if seen < value:
                futex.wait(self._addr + word * 8, seen, SLICE_S)
            w[sleep_word] = 0
            if w[word] >= value:
                if spin:
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
        """Between futex slices: raise if the segment was aborted, ``q`` left or died, or time ran out."""
        w = self._w
        if w[W_ABORT]:
            self._raise_aborted()
        peer = self.ranks[q]
        if w[self._line[q] + CONTROL_LEFT]:
            raise PeerLostError(f"rank {peer} closed its shared-memory group while rank {self.rank} waited", peer=peer)
        if peer in self._transport.lost_peers():
            raise PeerLostError(f"rank {peer} was lost during a shared-memory collective", peer=peer)
        pid = int(w[self._line[q] + CONTROL_PID])
        if pid and pid != os.getpid() and process_dead(pid):
            raise PeerLostError(f"rank {peer} (pid {pid}) died during a shared-memory collective", peer=peer)
        if time.monotonic() >= deadline:
            raise CommTimeoutError(
                f"rank {self.rank}: rank {peer} did not reach step {value} of the shared-memory collective in time; "
                "it may be slow, stuck, or calling another collective — raise the timeout or check that rank"
            )

    def _abort(self, why: int, lost: int | None = None) -> None:
        if self._mm is None or self._closed:
            return
        if not self._w[W_ABORT]:
            self._w[W_ABORT_WHY] = why
            self._w[W_ABORT_LOST] = 0 if lost is None else lost + 1
            self._w[W_ABORT] = self.index + 1  # last: a reader that sees it sees the words above (x86 TSO)
        self._wake_all()

    def _wake_all(self) -> None:
        with self._fence_lock:
            pass
        for q in range(self.size):
            futex.wake(self._addr + self._line[q] * 8)

    def _raise_aborted(self) -> None:
        who = int(self._w[W_ABORT]) - 1
        peer = self.ranks[who] if 0 <= who < self.size else -1
        if int(self._w[W_ABORT_WHY]) == _WHY_MISMATCH:  # only neighbour exchanges abort on a mismatch
            raise CollectiveMismatchError(
                f"rank {peer} found that its neighbours published different sizes (see its error); every rank must "
                "publish the same layout"
            )
        lost = int(self._w[W_ABORT_LOST]) - 1
        if int(self._w[W_ABORT_WHY]) == _WHY_LOST and 0 <= lost < self.size and lost != self.index:
            gone = self.ranks[lost]
            raise PeerLostError(
                f"rank {gone} was lost (rank {peer} saw it first and stopped the shared-memory group)", peer=gone
            )
        raise PeerLostError(f"rank {peer} failed inside a shared-memory collective; see its error", peer=peer)
