"""Gossip's neighbour exchange through a shared-memory segment: publish into my slot, read my neighbours' in place.

Why: when every worker of a D-PSGD job shares this host, a step's parameters need not travel as messages: each
rank copies them once into its own slot, and its neighbours mix them straight out of shared memory. A rank
waits only for the counters of the neighbours it reads, never for the whole group.

Protocol, on a :class:`~paratrain.shm.segment.Segment` of its own (its counters count exchanges, so the
segment cannot also carry collectives): exchange ``k`` (from 0) of rank r goes to r's slot ``k % 2`` with a
descriptor of its size, then r's counter becomes ``k + 1``. A reader of r's exchange ``k`` waits for r's
counter to reach ``k + 1``, compares r's descriptor with the size it expects, and reads r's slot in place.

Why two slots are enough: a rank overwrites slot ``k % 2`` at exchange ``k + 2``, after reading its neighbours'
exchange ``k + 1``, which each neighbour publishes only after it has read this rank's exchange ``k``. That holds
when neighbourhoods are symmetric (a rank reads its readers) and each rank finishes with the views of exchange
``k`` before it publishes ``k + 1`` — exactly D-PSGD's step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.collectives.signature import DESCRIPTOR_BYTES, Signature
from paratrain.errors import CollectiveMismatchError
from paratrain.shm.segment import DEFAULT_SPIN_MAX_S, DEFAULT_SPIN_S, Segment
from paratrain.transport.base import Transport

__all__ = ["ShmExchangeGroup"]

#: The algorithm name in an exchange's descriptor: the collectives' encoding, so that a collective that meets an
#: exchange on one segment reports it as a mismatch of kinds.
_ALGORITHM = "shm"

_Array = npt.NDArray[Any]


class ShmExchangeGroup:
    """The ranks of one host, joined by a shared-memory segment for neighbour exchanges (D-PSGD's step).

    Create it collectively with :meth:`create` (or wrap a fresh segment). Every member publishes once per
    exchange, in the same sequence; each reads only the peers it names in :meth:`peer_array`, and nobody waits for
    anyone else, so a slow rank delays its neighbours only. Not thread-safe: one thread per rank uses a group.

    Attributes:
        segment: the shared memory (:class:`~paratrain.shm.segment.Segment`).
        ranks: the member ranks (transport ranks), sorted.
        rank: this process's transport rank.
        capacity: the most bytes one exchange may publish.
        timeout: default timeout of :meth:`peer_array` (seconds).

    Example:
        >>> import numpy as np
        >>> from paratrain.testing import run_ranks
        >>> def body(ctx):
        ...     group = ShmExchangeGroup.create(ctx.transport, ranks=[0, 1], run_id="doc", timeout=10,
        ...                                     tag=ctx.next_collective_tag(), capacity=4096)
        ...     group.publish(np.full(3, float(ctx.rank)))
        ...     theirs = group.peer_array(1 - ctx.rank, np.float64, 3).tolist()
        ...     group.close()
        ...     return theirs
        >>> run_ranks(2, body)
        [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    """

    def __init__(self, segment: Segment) -> None:
        """Runs exchanges on ``segment``, which must carry nothing else; :meth:`create` makes one."""
        self.segment = segment
        self.ranks, self.rank = segment.ranks, segment.rank
        self.capacity = segment.capacity
        self.timeout = segment.timeout
        self._x = 0  # exchanges published
        self._descs: dict[int, bytes] = {}  # bytes published -> encoded descriptor

    @staticmethod
    def supported() -> bool:
        """True where shared memory between ranks is correct: x86-64 (see :mod:`paratrain.shm.segment`)."""
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
        capacity: int,
        spin: float = DEFAULT_SPIN_S,
        spin_max: float = DEFAULT_SPIN_MAX_S,
    ) -> ShmExchangeGroup:
        """Creates the group collectively: every rank in ``ranks`` calls this with the same arguments. Blocks.

        Args:
            transport: this rank's transport (used only during creation, and to learn of lost peers).
            ranks: the members, all on this host; this rank must be one of them.
            run_id: the job's id, part of the segment's name.
            timeout: seconds for creation, and the default timeout of :meth:`peer_array`.
            tag: a tag for the creation messages, the same on all members.
            capacity: the most bytes one exchange may publish (a multiple of 4096; memory: twice that per rank).
            spin, spin_max: how long a reader spins before sleeping (see
                :meth:`Segment.create <paratrain.shm.segment.Segment.create>`).

        Raises:
            ConfigError, PeerLostError, CommTimeoutError, TransportError: as
                :meth:`Segment.create <paratrain.shm.segment.Segment.create>`.
        """
        segment = Segment.create(
            transport,
            ranks=ranks,
            run_id=run_id,
            timeout=timeout,
            tag=tag,
            capacity=capacity,
            descriptor_bytes=DESCRIPTOR_BYTES,
            spin=spin,
            spin_max=spin_max,
            name="ShmExchangeGroup",
        )
        return cls(segment)

    def close(self) -> None:
        """Leaves the group (see :meth:`Segment.close <paratrain.shm.segment.Segment.close>`). Idempotent.

        Publishing never waits, so nothing is in flight: neighbours that already hold this rank's last exchange
        read it on; one that waits for a later exchange fails with ``PeerLostError``.
        """
        self.segment.close()

    def __enter__(self) -> ShmExchangeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, arr: _Array | Sequence[_Array]) -> None:
        """Posts ``arr`` for this rank's graph neighbours (exchange number k, counting from 0). Never waits.

        A sequence of arrays is laid out back to back, as their concatenated bytes (without a concatenated copy).
        Every member publishes once per exchange, in the same sequence; this rank must be done with the views of
        its previous exchange (see the module notes on why two slots suffice).

        Raises:
            ValueError: ``arr`` is larger than the group's ``capacity``.
            RuntimeError: the segment already carries collectives.
        """
        seg = self.segment
        seg.enter()
        try:
            seg.check_usable()
            seg.claim("neighbour exchanges")
            if not seg.mapped:
                return
            parts = [arr] if isinstance(arr, np.ndarray) else list(arr)
            flats = [np.ascontiguousarray(part).reshape(-1).view(np.uint8) for part in parts]
            nbytes = sum(flat.nbytes for flat in flats)
            if nbytes > self.capacity:
                raise ValueError(f"{nbytes} bytes do not fit the group's capacity of {self.capacity} bytes")
            k = self._x
            u8, start = seg.u8, seg.slot_offset(seg.index, k & 1)
            for flat in flats:
                u8[start : start + flat.nbytes] = flat
                start += flat.nbytes
            seg.describe(k & 1, self._descriptor(nbytes))
            self._x = k + 1
            seg.signal(k + 1)
        except BaseException as exc:
            seg.fail(exc)
            raise
        finally:
            seg.leave()

    def peer_array(self, peer: int, dtype: npt.DTypeLike, count: int, *, timeout: float | None = None) -> _Array:
        """What ``peer`` (a transport rank of the group) published in this rank's latest exchange. Blocks.

        Returns a view into shared memory of ``count`` items of ``dtype``, valid until this rank's next
        :meth:`publish` (see the module notes for why); copy it to keep it longer.

        Raises:
            ValueError: ``peer`` is not another member (the group stays usable).
            RuntimeError: this rank has not published yet.
            CollectiveMismatchError: ``peer`` published a different number of bytes.
            PeerLostError: ``peer`` died, left the group, or failed.
            CommTimeoutError: ``peer`` did not publish within the timeout.
        """
        seg = self.segment
        seg.check_usable()
        if peer not in self.ranks or peer == self.rank:  # a wrong argument: the group stays usable
            raise ValueError(f"peer {peer} is not another member of the group {list(self.ranks)}")
        if self._x == 0:
            raise RuntimeError("peer_array() before publish(): publish this rank's exchange first")
        seg.enter()
        try:
            k = self._x - 1
            dt = np.dtype(dtype)
            nbytes = count * dt.itemsize
            q = self.ranks.index(peer)
            if not seg.mapped:  # pragma: no cover - a one-member group has no peers
                raise ValueError("a one-member group has no peers")
            seg.wait_for(q, k + 1, time.monotonic() + (self.timeout if timeout is None else timeout))
            expected = self._descriptor(nbytes)
            if seg.descriptor(q, k & 1, len(expected)) != expected:
                theirs = Signature.decode(seg.descriptor(q, k & 1, DESCRIPTOR_BYTES))
                what = f"{theirs.shape[0]} bytes" if theirs.kind == "exchange" and theirs.shape else theirs.kind
                raise CollectiveMismatchError(
                    f"rank {self.rank} expected {nbytes} bytes from rank {peer} in neighbour exchange {k}, but it "
                    f"published {what}; every rank must build the same model"
                )
            start = seg.slot_offset(q, k & 1)
            return seg.u8[start : start + nbytes].view(dt)
        except BaseException as exc:
            seg.fail(exc)
            raise
        finally:
            seg.leave()

    def _descriptor(self, nbytes: int) -> bytes:
        """The encoded descriptor of an exchange of ``nbytes`` (cached: a model publishes one size)."""
        desc = self._descs.get(nbytes)
        if desc is None:
            if len(self._descs) >= 16:
                self._descs.clear()
            signature = Signature("exchange", None, "uint8", (nbytes,), _ALGORITHM, _ALGORITHM)
            desc = self._descs[nbytes] = signature.encode()
        return desc
