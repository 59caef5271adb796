"""One host's ranks joined by a shared-memory segment: the group's creation, its block numbering, and the
agreement step that opens every call (:class:`ShmMembers`).

The collectives that move data on it (allreduce, broadcast, publish) are :class:`~paratrain.collectives.shm.ShmGroup`,
which extends this; the protocol both follow (who writes which slot and descriptor at which counter value) is in
that module's notes.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, Self

from paratrain.collectives.shm_call import ALGORITHM, CallFrame, Descriptors, SettledError
from paratrain.collectives.shm_layout import DEFAULT_CAPACITY, DEFAULT_SMALL_BYTES, SlotLayout, result_bytes
from paratrain.collectives.signature import DESCRIPTOR_BYTES, INVALID, Signature, mismatch_error
from paratrain.errors import ConfigError
from paratrain.shm.segment import DEFAULT_SPIN_MAX_S, DEFAULT_SPIN_S, Segment

if TYPE_CHECKING:
    from paratrain.transport.base import Transport

__all__ = ["HostContext", "ShmMembers"]

_BARRIER = Signature("barrier", None, "", (), ALGORITHM, ALGORITHM)


class HostContext(Protocol):
    """What :meth:`ShmGroup.from_context` reads of a context (a :class:`paratrain.Context` has all of it).

    A protocol rather than an import, so that the collectives do not depend on the runtime that builds them.
    """

    @property
    def transport(self) -> Transport: ...

    @property
    def world_size(self) -> int: ...

    @property
    def local_world_size(self) -> int: ...

    @property
    def settings(self) -> _JobSettings: ...

    def next_collective_tag(self) -> int: ...


class _JobSettings(Protocol):
    @property
    def run_id(self) -> str: ...

    @property
    def timeout(self) -> float: ...


class ShmMembers:
    """The members of one host's segment: created collectively, numbering the blocks every call uses, and
    agreeing at the start of each call (see :class:`~paratrain.collectives.shm.ShmGroup` for the collectives and
    the attributes).
    """

    def __init__(self, segment: Segment, **_: Any) -> None:
        """The members of ``segment`` (``**_``: what a subclass takes besides, as :meth:`create` passes it)."""
        self.segment = segment
        self.ranks, self.rank, self.index, self.size = segment.ranks, segment.rank, segment.index, segment.size
        self.timeout = segment.timeout
        self.capacity = segment.capacity
        self._others = segment.others
        self._call = CallFrame(segment)
        self._k = 0  # next block number
        self._layout = SlotLayout(segment)  # the slots' views per block length (:mod:`.shm_layout`)
        self._descs = Descriptors()  # the calls' encoded signatures (:mod:`.shm_call`)

    # -- construction ------------------------------------------------------------------------------------------

    @staticmethod
    def supported() -> bool:
        """True where the shared-memory path is correct: x86-64 (see :mod:`paratrain.shm.segment`)."""
        return Segment.supported()

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
    ) -> Self:
        """Creates the group collectively: every rank in ``ranks`` calls this with the same arguments.

        The lowest rank creates the segment ``paratrain-{run_id}-shm-*`` in ``/dev/shm`` and sends its name to the
        others with ``tag``; each maps it and confirms; the creator then unlinks the name, so nothing is left on
        disk even if a process crashes later (see :meth:`Segment.create <paratrain.shm.segment.Segment.create>`).
        Blocks.

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
            spin_max: how far the spin may grow when waits keep ending just after the spin ran out; set it equal
                to ``spin`` to keep the spin fixed.

        Raises:
            ConfigError: bad arguments, or an architecture where the path is unsupported.
            PeerLostError, CommTimeoutError: a member died or did not answer in time.
            TransportError: the segment could not be created or mapped on some member.
        """
        ranks = list(ranks)
        members = Segment.members(transport, ranks, capacity=capacity, timeout=timeout, spin=spin, spin_max=spin_max)
        if capacity < 64 * len(members):
            raise ConfigError(f"capacity {capacity} is too small for {len(members)} ranks (need 64 bytes each)")
        if small_bytes < 0:
            raise ConfigError("small_bytes, spin and spin_max must be >= 0 and timeout > 0")
        if not cls.supported():
            raise ConfigError(
                f"the shared-memory collectives need x86-64 memory ordering; this is {platform.machine()}. "
                "Use algorithm='ring' or 'tree'."
            )
        segment = Segment.create(
            transport,
            ranks=ranks,
            run_id=run_id,
            timeout=timeout,
            tag=tag,
            capacity=capacity,
            descriptor_bytes=DESCRIPTOR_BYTES,
            extra=result_bytes(len(members), capacity),
            spin=spin,
            spin_max=spin_max,
            name="ShmGroup",
        )
        try:
            return cls(segment, small_bytes=small_bytes)
        except BaseException:
            segment.close()
            raise

    @classmethod
    def from_context(cls, ctx: HostContext, *, capacity: int = DEFAULT_CAPACITY, **kwargs: Any) -> Self:
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
        self._layout.clear()  # views of the mapping: the segment can unmap only once they are gone
        self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        with self._call:
            if not self.segment.mapped:
                return [signature]
            deadline = self._deadline(timeout)
            try:
                desc = self._descs.encode(signature)
            except (ValueError, TypeError) as exc:
                self._reject(exc, deadline)
            return self._agree(desc, deadline) or [signature] * self.size

    # -- the agreement step ------------------------------------------------------------------------------------

    def _agree(self, desc: bytes, deadline: float) -> list[Signature] | None:
        """An agreement step without data: see :meth:`_check_descriptors` for what it returns and raises."""
        seg = self.segment
        k = self._k
        seg.describe(k & 1, desc)
        seg.signal(2 * k + 1)
        seg.wait_all(2 * k + 1, deadline)
        sigs = self._check_descriptors(k, desc)
        self._k = k + 1
        return sigs

    def _reject(self, error: ValueError | TypeError, deadline: float) -> NoReturn:
        """This rank's arguments are invalid: it takes part in the agreement step with the "invalid" signature,
        so that the peers raise ``CollectiveMismatchError`` at once instead of waiting for it, then raises
        ``error`` (as :class:`SettledError`: the group stays usable). Called inside the handler of ``error``."""
        seg = self.segment
        if seg.mapped:
            k = self._k
            seg.describe(k & 1, self._descs.encode(INVALID))
            seg.signal(2 * k + 1)
            seg.wait_all(2 * k + 1, deadline)
            self._k = k + 1
        raise SettledError(error)

    def _check_descriptors(self, k: int, desc: bytes) -> list[Signature] | None:
        """The agreement of block ``k``, once every member has published it: None if every descriptor equals
        mine (a byte compare per peer), else every member's decoded signature if they differ only where that is
        allowed.

        Raises:
            SettledError: with the ``CollectiveMismatchError`` that every member raises (they all compute it from the
                same descriptors), after moving past block ``k`` like every other member: nobody reads any peer's
                data of this call, and all leave at the same step, so the group stays usable.
        """
        seg, pos, n = self.segment, k & 1, len(desc)
        for q in self._others:
            if seg.descriptor(q, pos, n) != desc:
                break
        else:
            return None
        sigs = [Signature.decode(seg.descriptor(q, pos, DESCRIPTOR_BYTES)) for q in range(self.size)]
        error = mismatch_error(sigs)
        if error is not None:
            self._k = k + 1
            raise SettledError(error)
        return sigs

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)
