"""In-process transport: ranks are threads of one process, for fast deterministic tests.

Messages go through the real wire encoder and decoder (so a test catches anything a socket would refuse) and
are copied, so a sender may reuse its arrays as soon as ``send`` returns, as with real transports. An
:class:`InprocFabric` connects the ranks; it is an object the test creates, not a global, so several jobs can
run in one process. ``fabric.fail_all(exc)`` wakes every rank blocked anywhere, which is how a test harness
turns one rank's failure into an error on all of them instead of a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from paratrain.errors import PeerLostError, TransportClosedError
from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Handle, Transport
from paratrain.transport.matching import Mailbox
from paratrain.transport.wire import Message, decode, encode

__all__ = ["InprocFabric", "InprocTransport"]


class InprocFabric:
    """The shared medium of ``world_size`` in-process ranks.

    Example:
        >>> fabric = InprocFabric(2)
        >>> a, b = fabric.transport(0), fabric.transport(1)
        >>> a.send(1, tag=7, meta={"hello": "world"})
        >>> b.recv(0, 7).meta["hello"]
        'world'
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._mailboxes = [Mailbox(rank=r, world_size=world_size) for r in range(world_size)]
        self._lock = threading.Lock()
        self._gone: dict[int, str] = {}
        self._incarnations: dict[int, int] = {}

    def rejoin(self, rank: int) -> InprocTransport:
        """A new endpoint for ``rank``, which left (crashed or closed): as a restarted process would, it comes
        back with an empty mailbox, and every other rank may send to it and wait on it again.

        Raises:
            ValueError: ``rank`` has not left.
        """
        with self._lock:  # all at once: a rank that sees the incarnation may wait on the newcomer at once
            if rank not in self._gone:
                raise ValueError(f"rank {rank} has not left; only a lost rank can rejoin")
            self._mailboxes[rank] = Mailbox(rank=rank, world_size=self.world_size)
            del self._gone[rank]
            for other, box in enumerate(self._mailboxes):
                if other != rank:
                    box.peer_back(rank)
            self._incarnations[rank] = self._incarnations.get(rank, 0) + 1
        return InprocTransport(self, rank)

    def incarnations(self) -> dict[int, int]:
        """How many times each rank rejoined (see :meth:`rejoin`)."""
        with self._lock:
            return dict(self._incarnations)

    def transport(self, rank: int) -> InprocTransport:
        """The endpoint of ``rank``."""
        return InprocTransport(self, rank)

    def mailbox(self, rank: int) -> Mailbox:
        """The mailbox of ``rank`` (used by its transport)."""
        return self._mailboxes[rank]

    def _deliver(self, msg: Message, dst: int) -> None:
        with self._lock:
            gone = self._gone.get(dst)
        if gone is not None:
            raise PeerLostError(f"rank {msg.src}: cannot send to rank {dst}, which {gone}", peer=dst)
        self._mailboxes[dst].deliver(msg)

    def _departed(self) -> frozenset[int]:
        with self._lock:
            return frozenset(r for r, how in self._gone.items() if how == "has shut down")

    def _leave(self, rank: int, how: str) -> None:
        with self._lock:
            if rank in self._gone:
                return
            self._gone[rank] = how
        for other, box in enumerate(self._mailboxes):
            if other != rank:
                box.peer_lost(
                    rank,
                    PeerLostError(
                        f"rank {other}: peer rank {rank} {how} while a message from it was awaited", peer=rank
                    ),
                )

    def fail_all(self, error: BaseException) -> None:
        """Fails every pending and future receive on every rank with ``error``."""
        for box in self._mailboxes:
            box.close(error)


class InprocTransport(Transport):
    """One rank's endpoint on an :class:`InprocFabric`. Thread-safe."""

    name = "inproc"

    def __init__(self, fabric: InprocFabric, rank: int) -> None:
        super().__init__(rank=rank, world_size=fabric.world_size, timeout=fabric.timeout)
        self._fabric = fabric
        self._box = fabric.mailbox(rank)
        self._closed = False

    def isend(
        self, dst: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
    ) -> Handle[None]:
        """Copies the message into ``dst``'s mailbox at once; the handle is already complete."""
        self._check_peer(dst)
        if self._closed:
            raise TransportClosedError(f"rank {self.rank}: transport closed; cannot send")
        frames, _ = encode(self.rank, tag, arrays, meta)
        copied = [bytes(f) for f in frames]
        msg = decode(copied)
        self._fabric._deliver(msg, dst)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += msg.nbytes
        return Handle.completed(None)

    def irecv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle[Message]:
        """Posts a receive on this rank's mailbox."""
        self._check_peer(src, allow_any=True)
        handle = self._box.post(src, tag)

        def count(h: Handle[Message]) -> None:
            if h.exception() is None:
                msg = h.wait(0)
                self.stats.messages_received += 1
                self.stats.bytes_received += msg.nbytes

        handle.add_done_callback(count)
        return handle

    def cancel_recv(self, handle: Handle[Message]) -> bool:
        """Withdraws a posted receive."""
        return self._box.cancel(handle)

    def lost_peers(self) -> frozenset[int]:
        """Ranks that closed or crashed."""
        return self._box.lost()

    def departed_peers(self) -> frozenset[int]:
        """Ranks that closed (rather than aborted)."""
        return self._fabric._departed()

    def incarnations(self) -> dict[int, int]:
        """Ranks that rejoined after they left (:meth:`InprocFabric.rejoin`), and how often."""
        return self._fabric.incarnations()

    def close(self) -> None:
        """Leaves the fabric; peers waiting on this rank get PeerLostError ("shut down")."""
        if self._closed:
            return
        self._closed = True
        self._fabric._leave(self.rank, "has shut down")
        self._box.close()

    def abort(self, reason: BaseException | None = None) -> None:
        """Leaves the fabric as a crash would."""
        if self._closed:
            return
        self._closed = True
        self._fabric._leave(self.rank, "crashed")
        self._box.close(reason or TransportClosedError(f"rank {self.rank}: transport aborted"))
