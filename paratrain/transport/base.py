"""The transport interface: point-to-point messages between ranks, blocking with timeouts or via handles.

Algorithms (collectives, parameter server, gossip) are written against :class:`Transport` only, and never
import a concrete transport. A message is a tag, a small ``meta`` map and zero or more arrays (see
:mod:`paratrain.transport.wire`). Matching follows MPI: a receive names a source rank (or :data:`ANY_SOURCE`)
and a tag (or :data:`ANY_TAG`); messages from one sender with one tag arrive in the order they were sent.

Thread safety: every method of every transport may be called from several threads at once.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from paratrain.errors import CommTimeoutError
from paratrain.transport.wire import Message

__all__ = ["ANY_SOURCE", "ANY_TAG", "Handle", "Transport", "TransportStats", "TransportWrapper"]

ANY_SOURCE = -1
ANY_TAG = -(1 << 62)

T = TypeVar("T")


class Handle(Generic[T]):
    """The pending result of a non-blocking call (``isend``/``irecv``/``*_async``).

    ``wait()`` blocks until the operation completes and returns its result or raises its error. Thread-safe;
    waiting twice returns the same result.
    """

    __slots__ = ("_callbacks", "_done", "_error", "_lock", "_result")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Handle[T]], None]] = []

    @classmethod
    def completed(cls, result: T) -> Handle[T]:
        """A handle that is already done with ``result``."""
        handle: Handle[T] = cls()
        handle.set_result(result)
        return handle

    def set_result(self, result: T) -> bool:
        """Completes the handle; returns False if it was already complete."""
        return self._finish(result, None)

    def set_error(self, error: BaseException) -> bool:
        """Fails the handle; returns False if it was already complete."""
        return self._finish(None, error)

    def _finish(self, result: T | None, error: BaseException | None) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)
        return True

    def add_done_callback(self, fn: Callable[[Handle[T]], None]) -> None:
        """Calls ``fn(handle)`` once complete (at once if it already is), in the completing thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        """True once the operation completed or failed. Never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """Blocks until done, then returns the result or raises the error.

        Raises:
            CommTimeoutError: not done within ``timeout`` seconds (the operation goes on).
        """
        if not self._done.wait(timeout):
            raise CommTimeoutError(
                f"operation not complete after {timeout}s; a peer may be slow or stuck — raise the timeout "
                "or check the other ranks"
            )
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def exception(self) -> BaseException | None:
        """The error if the handle failed, None otherwise (also None while pending)."""
        return self._error


class TransportStats:
    """Counters a transport keeps: messages and bytes sent/received, malformed messages dropped, connections
        refused (a handshake without the job's secret: see :mod:`paratrain.transport.auth`), messages sent through a
        shared-memory lane and those that found it full (:mod:`paratrain.transport.lane`), and messages dropped because
    their sender field was not the rank their connection authenticated as."""

    __slots__ = (
        "bytes_received",
        "bytes_sent",
        "dropped_malformed",
        "lane_full",
        "lane_messages",
        "messages_received",
        "messages_sent",
        "refused_connections",
        "spoofed_senders",
    )

    def __init__(self) -> None:
        self.messages_sent = 0
        self.bytes_sent = 0
        self.messages_received = 0
        self.bytes_received = 0
        self.dropped_malformed = 0
        self.refused_connections = 0
        self.spoofed_senders = 0
        self.lane_messages = 0
        self.lane_full = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for metrics files)."""
        return {name: getattr(self, name) for name in self.__slots__}


class Transport(abc.ABC):
    """Point-to-point messaging between the ranks of one job.

    Attributes:
        rank: this endpoint's rank.
        world_size: number of ranks.
        timeout: default timeout in seconds of blocking calls when ``timeout=None`` is passed.
        stats: traffic counters.
    """

    name: str = "abstract"

    def __init__(self, *, rank: int, world_size: int, timeout: float) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        #: The rendezvous round that formed this job as this transport sees it (an elastic job's, which changes
        #: membership from round to round; 0 where nobody counts).
        self.round = 0
        self.timeout = timeout
        self.stats = TransportStats()

    def _check_peer(self, peer: int, *, allow_any: bool = False) -> None:
        if allow_any and peer == ANY_SOURCE:
            return
        if type(peer) is not int or not 0 <= peer < self.world_size:
            raise ValueError(f"peer rank {peer!r} outside 0..{self.world_size - 1}")

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def send(
        self,
        dst: int,
        tag: int,
        arrays: Sequence[Any] = (),
        meta: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Sends a message; blocks until the arrays may be reused (they are copied or handed to the kernel).

        Raises:
            PeerLostError: ``dst`` is gone.
            CommTimeoutError: the message could not be handed over within the timeout (peer not reading).
            TransportClosedError: this transport was closed.
        """
        self.isend(dst, tag, arrays, meta).wait(self._timeout(timeout))

    @abc.abstractmethod
    def isend(
        self, dst: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
    ) -> Handle[None]:
        """Starts a send; the handle completes when the arrays may be reused. Does not block."""

    def recv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG, *, timeout: float | None = None) -> Message:
        """Receives the next message from ``src`` with ``tag``; blocks up to the timeout.

        Raises:
            PeerLostError: ``src`` is gone and sent nothing more that matches.
            CommTimeoutError: nothing matching arrived in time.
            TransportClosedError: this transport was closed.
        """
        handle = self.irecv(src, tag)
        try:
            return handle.wait(self._timeout(timeout))
        except CommTimeoutError:
            if self.cancel_recv(handle):
                raise CommTimeoutError(
                    f"rank {self.rank}: no message from "
                    f"{'any rank' if src == ANY_SOURCE else f'rank {src}'} with tag {tag} within "
                    f"{self._timeout(timeout)}s; the peer may be slow, stuck, or calling something else"
                ) from None
            # too late to withdraw: a message is claimed for this receive and must come out of it, or it is
            # lost. Usually it is already here; a wrapper (an emulated link) may still be carrying it
            return handle.wait(self._timeout(None))

    @abc.abstractmethod
    def irecv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle[Message]:
        """Posts a receive; the handle completes with the matching message. Does not block."""

    @abc.abstractmethod
    def cancel_recv(self, handle: Handle[Message]) -> bool:
        """Withdraws a posted receive; True if it was still pending (and now never completes)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Says goodbye to peers and releases sockets and threads. Idempotent."""

    @abc.abstractmethod
    def abort(self, reason: BaseException | None = None) -> None:
        """Stops at once without goodbye, as a crash would; pending operations fail. Idempotent."""

    @abc.abstractmethod
    def lost_peers(self) -> frozenset[int]:
        """Ranks known to be gone (crashed, killed, or shut down)."""

    def departed_peers(self) -> frozenset[int]:
        """The subset of :meth:`lost_peers` that shut down cleanly (said goodbye) rather than crashed.

        A transport that cannot tell says none (the default), so callers treat every loss as a crash.
        """
        return frozenset()

    #: True when this endpoint replaced its rank's lost process in a job that had met (a restarted parameter
    #: server, which must catch up before it serves): see :meth:`incarnations`.
    rejoined: bool = False

    def incarnations(self) -> dict[int, int]:
        """How many times each peer came back as a new process after it was lost (peers that never did are
        absent; a transport that cannot take a peer back says none, the default).

        Why callers look: a peer that rejoins (a restarted parameter server) knows nothing of what happened
        while it was gone, so a caller that saw it lost must bring it up to date before treating it as a live
        peer again, even if it never noticed the loss (:mod:`paratrain.ps.server`).
        """
        return {}

    def memory_prefix(self, peer: int) -> str | None:
        """The prefix of ``/dev/shm`` file names under which this rank and ``peer`` may offer each other memory to
        map (both on one host, with shared-memory lanes on: :mod:`paratrain.transport.lane`); None otherwise,
        the default. A parameter server lets such workers read its values in place (:mod:`paratrain.ps.shared`).
        """
        return None

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransportWrapper(Transport):
    """A transport over another one, ``inner``, that changes what it sends (faults, records): it takes the inner
    transport's rank, size, timeout and counters, and forwards receives and what is known of lost peers unless
    it overrides them."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(rank=inner.rank, world_size=inner.world_size, timeout=inner.timeout)
        self.inner = inner
        self.stats = inner.stats

    def irecv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle[Message]:
        """The inner transport's receive."""
        return self.inner.irecv(src, tag)

    def cancel_recv(self, handle: Handle[Message]) -> bool:
        """Withdraws the inner transport's receive."""
        return self.inner.cancel_recv(handle)

    def lost_peers(self) -> frozenset[int]:
        """Peers the inner transport knows to be gone."""
        return self.inner.lost_peers()

    def departed_peers(self) -> frozenset[int]:
        """Peers the inner transport saw shut down cleanly."""
        return self.inner.departed_peers()
