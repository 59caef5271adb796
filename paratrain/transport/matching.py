"""Matching of arrived messages with posted receives, shared by every transport.

A transport's network side calls :meth:`Mailbox.deliver`; receivers call :meth:`Mailbox.post`. A message is
given to the oldest posted receive that matches it, otherwise queued until one is posted. Messages of one
``(src, tag)`` are queued in arrival order, so per-sender order is kept. When a peer is lost, receives that
can only be satisfied by that peer fail with its :class:`~paratrain.errors.PeerLostError` — after anything it
sent before dying has been handed out, so no data is lost by failing early.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

from paratrain.errors import PeerLostError, TransportClosedError
from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Handle
from paratrain.transport.wire import Message

__all__ = ["Mailbox"]


class Mailbox:
    """Arrived-but-unclaimed messages and posted-but-unmatched receives of one rank. Thread-safe.

    A receive from any source fails once every peer is lost, unless ``peers_return`` (a lost peer's replacement
    may still come: see :meth:`peer_back`)."""

    def __init__(self, *, rank: int, world_size: int, peers_return: bool = False) -> None:
        self._rank = rank
        self._world_size = world_size
        self._peers_return = peers_return
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, int], deque[tuple[int, Message]]] = {}
        self._posted: list[tuple[int, int, Handle[Message]]] = []
        self._lost: dict[int, PeerLostError] = {}
        self._closed: BaseException | None = None
        self._seq = itertools.count()

    @staticmethod
    def _matches(src: int, tag: int, msg: Message) -> bool:
        return (src in (ANY_SOURCE, msg.src)) and (tag in (ANY_TAG, msg.tag))

    def deliver(self, msg: Message) -> None:
        """Hands ``msg`` to the oldest matching posted receive, or queues it."""
        with self._lock:
            if self._closed is not None:
                return
            match = next((i for i, (s, t, _) in enumerate(self._posted) if self._matches(s, t, msg)), None)
            if match is None:
                self._queues.setdefault((msg.src, msg.tag), deque()).append((next(self._seq), msg))
                return
            receiver = self._posted.pop(match)[2]
        receiver.set_result(msg)

    def _take(self, src: int, tag: int) -> Message | None:
        if src != ANY_SOURCE and tag != ANY_TAG:
            queue = self._queues.get((src, tag))
            if not queue:
                return None
            _, msg = queue.popleft()
            if not queue:
                del self._queues[(src, tag)]
            return msg
        best_key: tuple[int, int] | None = None
        best_seq = -1
        for key, queue in self._queues.items():
            if (src in (ANY_SOURCE, key[0])) and (tag in (ANY_TAG, key[1])):
                seq = queue[0][0]
                if best_key is None or seq < best_seq:
                    best_key, best_seq = key, seq
        if best_key is None:
            return None
        queue = self._queues[best_key]
        _, msg = queue.popleft()
        if not queue:
            del self._queues[best_key]
        return msg

    def _unsatisfiable(self, src: int) -> BaseException | None:
        if self._closed is not None:
            return self._closed
        if src != ANY_SOURCE:
            return self._lost.get(src)
        if self._world_size > 1 and len(self._lost) >= self._world_size - 1 and not self._peers_return:
            lost = sorted(self._lost)
            return PeerLostError(
                f"rank {self._rank}: every peer is gone (ranks {lost}); nothing can arrive any more",
                peer=lost[0],
            )
        return None

    def post(self, src: int, tag: int) -> Handle[Message]:
        """Posts a receive for ``(src, tag)`` (wildcards allowed) and returns its handle."""
        handle: Handle[Message] = Handle()
        with self._lock:
            msg = self._take(src, tag)
            if msg is None:
                error = self._unsatisfiable(src)
                if error is None:
                    self._posted.append((src, tag, handle))
                    return handle
        if msg is not None:
            handle.set_result(msg)
        else:
            handle.set_error(error)  # type: ignore[arg-type]
        return handle

    def cancel(self, handle: Handle[Message]) -> bool:
        """Removes a posted receive; True if it was still pending."""
        with self._lock:
            for i, (_, _, h) in enumerate(self._posted):
                if h is handle:
                    del self._posted[i]
                    return True
        return False

    def peer_lost(self, peer: int, error: PeerLostError) -> None:
        """Records that ``peer`` is gone and fails the receives only it could have satisfied."""
        with self._lock:
            if peer in self._lost or self._closed is not None:
                return
            self._lost[peer] = error
            failed = [(s, t, h) for (s, t, h) in self._posted if self._unsatisfiable(s) is not None]
            self._posted = [p for p in self._posted if self._unsatisfiable(p[0]) is None]
        for src, _, handle in failed:
            handle.set_error(self._unsatisfiable(src) or error)

    def peer_back(self, peer: int) -> None:
        """``peer`` rejoined as a new process: receives from it may wait again. Whatever its lost predecessor
        sent and nobody claimed is dropped (answers to requests that already failed over elsewhere)."""
        with self._lock:
            self._lost.pop(peer, None)
            for key in [k for k in self._queues if k[0] == peer]:
                del self._queues[key]

    def lost(self) -> frozenset[int]:
        """Peers recorded as lost."""
        with self._lock:
            return frozenset(self._lost)

    def close(self, error: BaseException | None = None) -> None:
        """Fails every pending receive with ``error`` (default: closed) and refuses new ones."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = error or TransportClosedError(f"rank {self._rank}: transport closed")
            posted, self._posted = self._posted, []
            self._queues.clear()
        for _, _, handle in posted:
            handle.set_error(self._closed)

    def pending(self) -> int:
        """Number of queued unclaimed messages (for diagnostics)."""
        with self._lock:
            return sum(len(q) for q in self._queues.values())
