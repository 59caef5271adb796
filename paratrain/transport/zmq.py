"""ZeroMQ transport: TCP between hosts, ipc (abstract unix sockets) inside a host.

Each rank binds one PULL socket (on TCP, and on an abstract ipc name on Linux) and connects one PUSH socket to
every peer, choosing ipc when both share a host id. Sends run in the caller's thread under a per-peer lock;
arrays above :data:`COPY_THRESHOLD` bytes are handed to ZeroMQ without copying and the call (or the handle)
completes when ZeroMQ is done with them. Inside a host, messages of at least
:data:`~paratrain.transport.lane.LANE_THRESHOLD` bytes carry their arrays through a shared-memory lane instead
(copied once into memory the receiver maps; the socket carries the header; ``lane_bytes`` per peer, 0: off),
and their send completes at once. A receiver thread drains the PULL socket, validates every message
(malformed ones are logged and dropped: a peer cannot crash us), and hands them to the matching engine.

Failure detection, because a hang is the worst failure:

* a peer that closes cleanly sends ``bye``; later receives that wait on it fail at once;
* a peer that crashes or is killed drops its connections; the socket monitor sees it and, unless a ``bye``
  arrives within a short grace period, the peer is declared lost;
* a peer that goes silent (hung host, cut cable) is declared lost after ``heartbeat_timeout`` seconds without
  any message; every rank sends a heartbeat to every peer each ``heartbeat`` seconds.

A *resilient* transport (a job the launcher restarts ranks of, ``--max-restarts``) goes further, because its
survivors must all stop and re-form the job, not only those that waited on the dead rank: a crash fails every
pending and later receive at once, and the rank tells every other peer (a ``lost`` control message), which do
the same. So a ring's rank that waits on a live neighbour learns of a death three hops away in one message
time rather than through a cascade of time-outs, and the grace for a goodbye shrinks to 0.1 s. A job with
replicated parameter servers asks for the short grace only (``quick_failover``): a dead server's chunks fail over
to their backups that much sooner, while a crash still fails only the receives that wait on the dead peer.

Authentication: given the job's ``secret``, the PULL socket's TCP endpoint is a CURVE server and its ipc endpoint
a PLAIN server with a password derived from the secret, every PUSH authenticates accordingly, and a
:class:`~paratrain.transport.auth.Guard` (this transport's ZAP handler) accepts only the job's credentials: a
process without the secret cannot deliver a single message, and each refused connection is counted in
``stats.refused_connections`` and logged (rate-limited). Why CURVE on TCP and a password on ipc, and what it
costs: :mod:`paratrain.transport.auth`. Without a secret the sockets accept anyone (tests, and jobs run with
``PARATRAIN_INSECURE=1``).

A lost peer may come back as a new process (a restarted parameter server, ``connect(rejoin=True)``): its first
message on each link is a ``hello`` with its new endpoints; the receiver thread then connects to it afresh, forgets
that it was lost and counts the incarnation (:meth:`ZmqTransport.incarnations`), so that the caller, who may have
missed the death, still knows that this peer remembers nothing. A resilient job ignores it (it re-forms instead).

Authentication is in :mod:`.auth`, the lanes' memory in :mod:`.lane`, the receiver thread and what it learns of
the peers in :mod:`.zmq_peers`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.transport.auth import Guard, JobKeys, RefusalLog
from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Handle
from paratrain.transport.lane import LANE_THRESHOLD, LaneReader, LaneWriter, lanes_supported, safe_run_id
from paratrain.transport.matching import Mailbox
from paratrain.transport.wire import (
    MAX_FRAME_BYTES,
    Message,
    decode,
    encode,
    encode_header,
    encode_prepared,
    prepare,
)
from paratrain.transport.zmq_peers import IPC_FRAME_BYTES, TAG_CONTROL, TCP_FRAME_BYTES, ZmqPeers

__all__ = ["COPY_THRESHOLD", "TAG_CONTROL", "ZmqTransport"]

log = logging.getLogger("paratrain.transport.zmq")

#: Messages with at least this many data bytes are sent zero-copy (ZeroMQ's own crossover is 64 KiB).
COPY_THRESHOLD = 1 << 16
_DISCONNECT_GRACE = 0.5
_RESILIENT_GRACE = 0.1
#: Seconds a closing rank waits for the goodbyes of peers that close with it (see :meth:`ZmqTransport.close`).
_GOODBYE_WAIT_S = 0.25


class _SendHandle(Handle[None]):
    """A send whose buffers ZeroMQ still holds; completes when its tracker is done or the peer is lost."""

    __slots__ = ("_peer", "_tracker", "_transport")

    def __init__(self, tracker: zmq.MessageTracker, transport: ZmqTransport, peer: int) -> None:
        super().__init__()
        self._tracker = tracker
        self._transport = transport
        self._peer = peer

    def done(self) -> bool:
        if not super().done() and (self._tracker.done or self._transport._lost_error(self._peer) is not None):
            self._resolve()
        return super().done()

    def _resolve(self) -> None:
        if self._tracker.done or self._peer in self._transport._said_bye:
            # a peer that shut down cleanly took what it wanted: the ring's last segment, say, arrives, the peer
            # finishes and says goodbye before ZeroMQ has released our buffer. Not an error. (The buffer stays
            # alive while ZeroMQ holds it: the frame keeps a reference.)
            self.set_result(None)
        else:
            error = self._transport._lost_error(self._peer)
            if error is not None:
                self.set_error(error)

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not super().done():
            step = 0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))
            with contextlib.suppress(zmq.NotDone):
                self._tracker.wait(step)
            self._resolve()
            if not super().done() and deadline is not None and time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"rank {self._transport.rank}: send to rank {self._peer} not delivered after {timeout}s; "
                    "is that rank alive and receiving?"
                )
        return super().wait(0)


class ZmqTransport(ZmqPeers):
    """Point-to-point messaging over ZeroMQ. Thread-safe.

    Construct, publish :meth:`endpoints` to the other ranks (rendezvous), then :meth:`connect` with everyone's
    endpoints. ``paratrain.init()`` does all of this.

    Args:
        rank: this rank.
        world_size: number of ranks.
        host_id: ranks with equal host ids use ipc between them.
        bind_addr: IP address to bind TCP on and advertise (reachable by the other ranks).
        run_id: job identifier, part of the ipc names so that jobs do not collide.
        timeout: default timeout of blocking calls (s).
        heartbeat: seconds between heartbeats.
        heartbeat_timeout: seconds of silence before a peer is declared lost.
        use_ipc: allow ipc inside a host (Linux only).
        on_peer_lost: called as ``on_peer_lost(peer, reason)`` (in the receiver thread) when a peer is
            declared lost; the launcher uses it to tell a root failure from the failures it caused.
        resilient: a crashed peer breaks every receive and is reported to the other peers (see the module
            docstring); for jobs that recover from failures (:mod:`paratrain.recovery`).
        secret: the job's secret (every rank's the same): connections are authenticated with keys derived from it
            (see the module docstring). None: no authentication, anyone who reaches the sockets may send.
        quick_failover: a dropped connection without a goodbye is a lost peer after 0.1 s rather than 0.5 s
            (implied by ``resilient``; replicated parameter servers use it alone).
        lane_bytes: shared-memory lane per peer inside a host (0: off).
        rank_bound: ranks a connection may authenticate as until :meth:`renumber` (default ``world_size``). An
            elastic member learns its rank and the job's size from its admission, which its peers receive too and
            may connect on first: its listener must accept every rank the job can have (``job_workers``).
        peers_return: a lost peer may come back (its replacement's ``hello``): a receive from any source waits
            even when every peer is lost (a parameter server holding a dead worker's place, :mod:`paratrain.ps.rejoin`).
    """

    name = "zmq"

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        host_id: str,
        bind_addr: str = "127.0.0.1",
        run_id: str = "default",
        timeout: float = 300.0,
        heartbeat: float = 1.0,
        heartbeat_timeout: float = 30.0,
        use_ipc: bool = True,
        on_peer_lost: Callable[[int, str], None] | None = None,
        resilient: bool = False,
        secret: bytes | None = None,
        quick_failover: bool = False,
        lane_bytes: int = 64 << 20,
        rank_bound: int | None = None,
        peers_return: bool = False,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, timeout=timeout)
        self._run_id = run_id
        self._rank_bound = max(world_size, rank_bound or 0)
        self._lane_bytes = lane_bytes if lanes_supported() else 0
        self._lane_writers: dict[int, LaneWriter | None] = {}  # None: creating it failed, use the socket
        self._lane_readers: dict[int, LaneReader] = {}  # the receiver thread's
        self.resilient = resilient
        self._grace = _RESILIENT_GRACE if resilient or quick_failover else _DISCONNECT_GRACE
        self.host_id = host_id
        self._heartbeat = heartbeat
        self._heartbeat_timeout = heartbeat_timeout
        self._on_peer_lost = on_peer_lost
        self._ctx = zmq.Context(io_threads=1)
        self._box = Mailbox(rank=rank, world_size=world_size, peers_return=peers_return)
        self._closed = False
        self._close_lock = threading.Lock()
        try:
            self._keys = JobKeys.derive(secret) if secret is not None else None
        except BaseException:
            self._ctx.term()
            raise
        self._guard: Guard | None = None
        if self._keys is not None:
            self._guard = Guard(
                self._ctx, self._keys, name=f"rank {rank}", on_refused=self._count_refusal, ranks=self._world
            )
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        # authenticated links cut arrays into frames their listener refuses beyond (TCP_FRAME_BYTES, IPC_FRAME_BYTES);
        # without a secret anyone may send whole messages anyway, so arrays keep one frame each (no join on receipt)
        self._max_frame: int | None = MAX_FRAME_BYTES if self._keys is not None else None
        self._link_frame: dict[int, int | None] = {}  # per peer: the frame limit of the link to it
        # what a peer with the secret may still send wrong, logged rate-limited (the receiver thread's)
        self._spoof_log = RefusalLog(lambda line: log.error("%s", line), nouns=("spoofed", "spoofed messages dropped"))
        self._malformed_log = RefusalLog(lambda line: log.error("%s", line), nouns=("malformed", "malformed dropped"))
        if self._max_frame is not None:
            JobKeys.limit_strangers(self._pull, max_frame=TCP_FRAME_BYTES)
        if self._guard is not None and self._keys is not None:
            self._guard.watch(self._pull)
            self._keys.serve_curve(self._pull, domain="tcp")
        self._pull.bind(f"tcp://{bind_addr}:0")
        tcp_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        ipc_endpoint = ""
        if use_ipc and sys.platform.startswith("linux"):
            safe_run = "".join(c if c.isalnum() else "_" for c in run_id)[:24]
            ipc_endpoint = f"ipc://@paratrain-{safe_run}-{rank}-{os.getpid()}-{secrets.token_hex(4)}"
            if self._guard is not None and self._keys is not None:
                self._keys.serve_plain(self._pull, domain="ipc")
                self._guard.allow_ipc("ipc", ipc_endpoint)
                JobKeys.limit_strangers(self._pull, max_frame=IPC_FRAME_BYTES)
            self._pull.bind(ipc_endpoint)
        if self._guard is not None:
            self._guard.start()
        self._endpoints = {"tcp": tcp_endpoint, "ipc": ipc_endpoint, "host": host_id, "pid": os.getpid()}
        self._wake_addr = f"inproc://wake-{id(self)}-{secrets.token_hex(4)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._push: dict[int, zmq.Socket[bytes]] = {}
        self._push_locks: dict[int, threading.Lock] = {}
        self._monitors: dict[int, zmq.Socket[bytes]] = {}
        self._peer_info: dict[int, Mapping[str, Any]] = {}
        self._last_heard: dict[int, float] = {}
        self._said_bye: set[int] = set()
        self._suspect: dict[int, float] = {}
        self._linked: set[int] = set()  # peers our PUSH has completed a handshake with
        self._linked_cond = threading.Condition()
        self._left_cond = threading.Condition()  # notified when a peer is lost or says goodbye
        self._lost: dict[int, PeerLostError] = {}
        self._incarnations: dict[int, int] = {}
        self._state_lock = threading.Lock()
        self._poller: zmq.Poller | None = None  # the receiver thread's (a rejoining peer's monitor joins it)
        self._monitor_peer: dict[zmq.Socket[bytes], int] = {}
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None

    def endpoints(self) -> dict[str, Any]:
        """What other ranks need to reach this one: TCP and ipc endpoints, host id, pid."""
        return dict(self._endpoints)

    def peer_endpoints(self, peer: int) -> dict[str, Any]:
        """What rank ``peer`` published (its :meth:`endpoints`), once connected; for diagnostics."""
        return dict(self._peer_info[peer])

    @property
    def authenticated(self) -> bool:
        """True when connections are authenticated with the job's secret."""
        return self._keys is not None

    def _count_refusal(self) -> None:
        self.stats.refused_connections += 1

    def _world(self) -> int:
        """The ranks a connection may authenticate as (the Guard's thread reads it: ranks at or above it are
        refused): the world size, or the job's largest until an elastic member is renumbered."""
        return self._rank_bound

    def host_ids(self) -> list[str]:
        """The host id of every rank (after :meth:`connect`); equal ids share a host."""
        return [
            self.host_id if r == self.rank else str(self._peer_info[r].get("host", "")) for r in range(self.world_size)
        ]

    def renumber(self, rank: int, world_size: int) -> None:
        """Takes the rank and world size an elastic rendezvous gave this process (before :meth:`connect`).

        An elastic job's members learn their place only from the round's answer, after they published their
        endpoints (which do not depend on the rank); nothing can have arrived yet, as no peer knows them.

        Raises:
            RuntimeError: already connected.
        """
        if self._thread is not None:
            raise RuntimeError(f"rank {self.rank}: renumber() after connect()")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
        self.rank, self.world_size = rank, world_size
        self._rank_bound = world_size
        self._box = Mailbox(rank=rank, world_size=world_size)

    def connect(self, table: Sequence[Mapping[str, Any]], *, rejoin: bool = False) -> None:
        """Connects to every peer given everyone's :meth:`endpoints` (indexed by rank) and starts receiving.

        ``rejoin``: this process replaces this rank's lost one (a restarted parameter server): it first sends
        every peer a ``hello`` with its endpoints, and each peer that is not resilient connects to it afresh and
        takes it back (:meth:`incarnations`); the table's entry for this rank is ignored.
        """
        if len(table) != self.world_size:
            raise ValueError(f"endpoint table has {len(table)} entries for world size {self.world_size}")
        now = time.monotonic()
        self.rejoined = rejoin
        hello = encode(self.rank, TAG_CONTROL, (), {"ctl": "hello", **self._endpoints})[0] if rejoin else None
        for peer, info in enumerate(table):
            if peer == self.rank:
                continue
            sock, monitor = self._open_push(peer, info)
            if hello is not None:
                sock.send_multipart(hello, flags=zmq.NOBLOCK)  # queued: the first message on the link
            self._monitors[peer] = monitor
            self._push[peer] = sock
            self._push_locks[peer] = threading.Lock()
            self._peer_info[peer] = dict(info)
            self._last_heard[peer] = now
        self._thread = threading.Thread(target=self._run, name=f"paratrain-zmq-rx-{self.rank}", daemon=True)
        self._thread.start()

    # -- sending ---------------------------------------------------------------------------------------

    def isend(
        self, dst: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
    ) -> Handle[None]:
        """Queues a message to ``dst``; the handle completes when its arrays may be reused. Never blocks."""
        self._check_peer(dst)
        if tag == TAG_CONTROL:
            raise ValueError(f"tag {TAG_CONTROL} is reserved for the transport")
        if self._closed:
            raise TransportClosedError(f"rank {self.rank}: transport closed; cannot send")
        views, descriptors = prepare(arrays)
        nbytes = sum(v.nbytes for v in views)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes
        if dst == self.rank:
            frames = encode_prepared(self.rank, tag, meta, views, descriptors, max_frame=None)
            self._box.deliver(decode([bytes(f) for f in frames]))
            return Handle.completed(None)
        error = self._lost_error(dst)
        if error is not None:
            raise error
        if self._thread is None:
            raise TransportClosedError(f"rank {self.rank}: transport not connected; call connect() first")
        big = nbytes >= COPY_THRESHOLD
        with self._push_locks[dst]:
            sock = self._push[dst]
            if nbytes >= LANE_THRESHOLD and self._lane_bytes:
                writer = self._lane_writer(dst)
                offset = writer.put(views) if writer is not None else None
                if writer is not None and offset is not None:
                    sock.send(encode_header(self.rank, tag, meta or {}, descriptors, [writer.name, offset]))
                    self.stats.lane_messages += 1
                    return Handle.completed(None)
                if writer is not None:
                    self.stats.lane_full += 1
            frames = encode_prepared(self.rank, tag, meta, views, descriptors, max_frame=self._link_frame[dst])
            if not big:
                sock.send_multipart(frames, copy=True)
                return Handle.completed(None)
            tracker = sock.send_multipart(frames, copy=False, track=True)
        assert tracker is not None  # track=True always returns one
        return _SendHandle(tracker, self, dst)

    def memory_prefix(self, peer: int) -> str | None:
        """``paratrain-<run>-``, when ``peer`` shares this host and lanes are on (see :class:`Transport`)."""
        info = self._peer_info.get(peer, {})
        if not (self._lane_bytes and info.get("host") == self.host_id and info.get("ipc") and self._endpoints["ipc"]):
            return None
        return f"paratrain-{safe_run_id(self._run_id)}-"

    def _lane_writer(self, dst: int) -> LaneWriter | None:
        """The lane to ``dst`` (created at the first bulk message), or None: not on this host, or it failed."""
        if dst in self._lane_writers:
            return self._lane_writers[dst]
        writer = None
        if self.memory_prefix(dst) is not None:
            try:
                writer = LaneWriter(run_id=self._run_id, src=self.rank, dst=dst, capacity=self._lane_bytes)
            except OSError as exc:
                log.warning("rank %d: no shared-memory lane to rank %d (%s); using its socket", self.rank, dst, exc)
        self._lane_writers[dst] = writer
        return writer

    # -- receiving -------------------------------------------------------------------------------------

    def irecv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle[Message]:
        """Posts a receive; completed by the receiver thread."""
        self._check_peer(src, allow_any=True)
        return self._box.post(src, tag)

    def cancel_recv(self, handle: Handle[Message]) -> bool:
        """Withdraws a posted receive."""
        return self._box.cancel(handle)

    # -- shutdown --------------------------------------------------------------------------------------

    def _stop_thread(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            with self._wake_lock:
                self._wake_tx.send(b"x")
            self._thread.join(timeout=10)

    def close(self) -> None:
        """Sends ``bye`` to every live peer, flushes queued sends (up to 2 s each), releases everything.

        A peer that left is gone for good: what is still queued for it can never be delivered, and lingering on it
        holds the close for the full 2 s. Ranks that finish together close at once, each before the others'
        goodbyes arrive (the end of 3 in 5 two-rank jobs took 2 s more); so a closing rank first waits up to
        :data:`_GOODBYE_WAIT_S` for the goodbyes of the peers still in the job, and lingers only on the others. It
        says goodbye to a peer that said it first as well: that peer may be waiting for it.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        crashed = self.lost_peers() - self.departed_peers()
        for peer in self._push:
            if peer not in crashed:  # to those that said goodbye too: they may be waiting for this one
                self._send_control(peer, "bye", blocking_lock=True)
        if self._thread is not None and self._thread.is_alive():
            deadline = time.monotonic() + _GOODBYE_WAIT_S
            with self._left_cond:
                while not set(self._push) <= self.lost_peers() and time.monotonic() < deadline:
                    self._left_cond.wait(max(0.0, deadline - time.monotonic()))
        self._stop_thread()
        gone = self.lost_peers() | self._unread_goodbyes()
        self._box.close()
        for peer, sock in self._push.items():
            sock.setsockopt(zmq.LINGER, 0 if peer in gone else 2000)
        self._release()

    def abort(self, reason: BaseException | None = None) -> None:
        """Drops all connections at once, without goodbye, as a crash would."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop_thread()
        self._box.close(reason or TransportClosedError(f"rank {self.rank}: transport aborted"))
        self._release()

    def _release(self) -> None:
        for held in (self._spoof_log, self._malformed_log):  # the receiver thread has stopped
            held.flush(f"rank {self.rank}")
        for mon in self._monitors.values():
            mon.close(linger=0)
        for sock in self._push.values():
            sock.close()
        self._pull.close(linger=0)
        if self._guard is not None:  # after the socket it guards: it must answer until that is gone
            self._guard.close()
        self._wake_rx.close(linger=0)
        self._wake_tx.close(linger=0)
        self._ctx.term()
        for writer in self._lane_writers.values():
            if writer is not None:
                writer.close()
        self._lane_writers.clear()
        self._lane_readers.clear()
