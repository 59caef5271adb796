"""The receiver thread of :class:`~paratrain.transport.zmq.ZmqTransport` and what it learns of the peers.

The thread drains the PULL socket (every message validated; malformed ones are logged and dropped), reads the
arrays of lane messages from the sender's shared memory, watches each PUSH socket's monitor, sends heartbeats and
declares peers lost: on a dropped connection without a goodbye, a refused handshake, a same-host peer whose process
is gone, or silence. It also takes back a peer that rejoined as a new process (its ``hello``). The failure rules
are the transport's module docstring's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from paratrain._process import process_dead
from paratrain.errors import CommTimeoutError, MessageError, PeerLostError, TransportClosedError
from paratrain.transport.auth import REFUSAL_EVENTS, JobKeys, RefusalLog, refusal_reason
from paratrain.transport.base import Transport
from paratrain.transport.lane import LaneReader, LaneWriter
from paratrain.transport.matching import Mailbox
from paratrain.transport.wire import MAX_FRAME_BYTES, decode, encode

__all__ = ["IPC_FRAME_BYTES", "TAG_CONTROL", "TCP_FRAME_BYTES", "ZmqPeers"]

log = logging.getLogger("paratrain.transport.zmq")  # the transport's own: one logger for its messages

#: The longest frame on an authenticated TCP link: CURVE encrypts 1 MiB frames faster than longer ones (16 MiB
#: messages 1.6-1.9x the bandwidth of one 16 MiB frame, joins included), and a stranger's handshake frame costs
#: at most this much.
TCP_FRAME_BYTES = 1 << 20
#: The longest frame on an authenticated ipc link (same host: large messages usually take a lane; those that find
#: it full keep long frames, joined rarely).
IPC_FRAME_BYTES = MAX_FRAME_BYTES

#: Tag of transport-internal control messages (heartbeat, bye); refused from users.
TAG_CONTROL = -(1 << 61)


class _LaneError(MessageError):
    """A lane message from ``src`` that cannot be read (bad name, offset or record)."""

    def __init__(self, src: int, why: str) -> None:
        super().__init__(why)
        self.src = src


class ZmqPeers(Transport):
    """The peers' side of a ZeroMQ transport: links, the receiver thread, lost peers and peers back.

    The state is the transport's (:class:`~paratrain.transport.zmq.ZmqTransport` builds it); the receiver
    thread (:meth:`_run`) is the only writer of most of it, under ``_state_lock`` where callers read it.
    """

    host_id: str
    resilient: bool
    _run_id: str
    _endpoints: dict[str, Any]
    _ctx: zmq.Context[zmq.Socket[bytes]]
    _keys: JobKeys | None
    _spoof_log: RefusalLog
    _malformed_log: RefusalLog
    _max_frame: int | None
    _link_frame: dict[int, int | None]
    _box: Mailbox
    _closed: bool
    _grace: float
    _heartbeat: float
    _heartbeat_timeout: float
    _on_peer_lost: Callable[[int, str], None] | None
    _pull: zmq.Socket[bytes]
    _wake_rx: zmq.Socket[bytes]
    _push: dict[int, zmq.Socket[bytes]]
    _push_locks: dict[int, threading.Lock]
    _monitors: dict[int, zmq.Socket[bytes]]
    _monitor_peer: dict[zmq.Socket[bytes], int]
    _poller: zmq.Poller | None
    _peer_info: dict[int, Mapping[str, Any]]
    _last_heard: dict[int, float]
    _said_bye: set[int]
    _suspect: dict[int, float]
    _linked: set[int]
    _linked_cond: threading.Condition
    _left_cond: threading.Condition
    _lost: dict[int, PeerLostError]
    _incarnations: dict[int, int]
    _state_lock: threading.Lock
    _fatal: BaseException | None
    _lane_writers: dict[int, LaneWriter | None]
    _lane_readers: dict[int, LaneReader]

    def _open_push(self, peer: int, info: Mapping[str, Any]) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """A PUSH socket connected to ``peer``, which published ``info`` (ipc on this host), and its monitor; notes
        the link's frame limit (its listener's)."""
        same_host = info.get("host") == self.host_id and bool(info.get("ipc")) and bool(self._endpoints["ipc"])
        address = str(info["ipc"] if same_host else info["tcp"])
        limit = IPC_FRAME_BYTES if same_host else TCP_FRAME_BYTES
        self._link_frame[peer] = limit if self._keys is not None else None
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self._keys is not None:
            self._keys.authenticate_client(sock, address, rank=self.rank)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED | REFUSAL_EVENTS
        )
        sock.connect(address)
        return sock, monitor

    def incarnations(self) -> dict[int, int]:
        """Peers that came back as a new process after they were lost (a ``hello``), and how often."""
        with self._state_lock:
            return dict(self._incarnations)

    def wait_linked(self, timeout: float) -> None:
        """Blocks until this rank's connection to every live peer has completed its handshake. Thread-safe.

        Not needed to send (messages queue until then); for a caller that must know its first messages left
        before, say, it aborts on purpose (tests), and to see a refused handshake before the first message.

        Raises:
            CommTimeoutError: some handshakes not done within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._linked_cond:
            while True:
                missing = set(self._push) - self._linked - self.lost_peers()
                remaining = deadline - time.monotonic()
                if not missing:
                    return
                if remaining <= 0:
                    raise CommTimeoutError(
                        f"rank {self.rank}: no completed handshake with ranks {sorted(missing)} within {timeout}s; "
                        "are they alive, and do they hold this job's PARATRAIN_SECRET?"
                    )
                self._linked_cond.wait(min(remaining, 0.1))

    def _lost_error(self, peer: int) -> PeerLostError | None:
        with self._state_lock:
            return self._lost.get(peer)

    def _resolve_lane(
        self, src: int, lane: Any, specs: list[tuple[np.dtype[Any], list[int], int]]
    ) -> list[npt.NDArray[Any]]:
        """The arrays of a message from ``src`` that lie in its lane (the receiver thread's wire callback)."""
        if not (isinstance(lane, list) and len(lane) == 2 and isinstance(lane[0], str) and type(lane[1]) is int):
            raise _LaneError(src, f"lane field {lane!r} is not [name, offset]")
        reader = self._lane_readers.get(src)
        try:
            if reader is None or reader.name != lane[0]:
                reader = LaneReader(run_id=self._run_id, src=src, dst=self.rank, name=lane[0])
                self._lane_readers[src] = reader  # a restarted sender's new lane replaces its predecessor's
            return reader.arrays(lane[1], specs)
        except MessageError as exc:
            raise _LaneError(src, str(exc)) from None

    def lost_peers(self) -> frozenset[int]:
        """Peers declared lost (crashed, killed, silent, or shut down)."""
        with self._state_lock:
            return frozenset(self._lost)

    def departed_peers(self) -> frozenset[int]:
        """Peers that said goodbye (``bye``) before their connection closed."""
        with self._state_lock:
            return frozenset(self._said_bye)

    def _declare_lost(self, peer: int, why: str, *, expected: bool = False) -> None:
        info = self._peer_info.get(peer, {})
        error = PeerLostError(
            f"rank {self.rank}: peer rank {peer} (pid {info.get('pid', '?')}, {info.get('tcp', '?')}) {why}. "
            "If it crashed, its own output says why; restart the job (or use an elastic strategy).",
            peer=peer,
        )
        with self._state_lock:
            if peer in self._lost:
                return
            self._lost[peer] = error
        with self._left_cond:
            self._left_cond.notify_all()
        if expected:
            log.debug("%s", error)
        else:
            log.warning("%s", error)
        if self._on_peer_lost is not None:
            try:
                self._on_peer_lost(peer, why)
            except Exception:  # a reporting hook must not break failure detection
                log.exception("rank %d: on_peer_lost hook failed", self.rank)
        self._box.peer_lost(peer, error)
        if self.resilient and not expected:
            for other in self._push:
                if other != peer and other not in self.lost_peers():
                    self._send_control(other, "lost", blocking_lock=True, peer=peer)
            self._box.close(error)

    def _peer_process_alive(self, peer: int) -> bool:
        """False only when ``peer`` runs on this host and its process is gone (or a zombie, dead but not yet
        reaped by its parent); True where this rank cannot tell (another host, no pid)."""
        info = self._peer_info.get(peer, {})
        pid = info.get("pid")
        if info.get("host") != self.host_id or type(pid) is not int or pid <= 0:
            return True
        return not process_dead(pid)

    def _sender(self, frames: list[zmq.Frame]) -> int | None:
        """The rank the connection that delivered ``frames`` authenticated as (its Guard's ``User-Id``); None
        without a secret (nobody authenticates); -1 if it carries none (the sender field then cannot be trusted)."""
        if self._keys is None:
            return None
        try:
            user = frames[0].get("User-Id")
        except (zmq.ZMQError, AttributeError):  # not a frame of an authenticated connection
            return -1
        return int(user) if isinstance(user, str) and user.isdigit() else -1

    def _spoofed(self, claimed: int, bound: int) -> None:
        """Drops a message whose sender field is not the rank its connection authenticated as (rate-limited log)."""
        self.stats.spoofed_senders += 1
        self._spoof_log.refused(
            f"rank {self.rank} dropped a message claiming to come from rank {claimed} on a connection that "
            f"authenticated as rank {bound}"
        )

    def _handle_frames(self, frames: list[zmq.Frame]) -> None:
        bound = self._sender(frames)
        try:
            msg = decode(frames, self._resolve_lane, max_frame=self._max_frame)
            if not 0 <= msg.src < self.world_size or msg.src == self.rank:
                raise MessageError(f"sender rank {msg.src} is not a peer of rank {self.rank}")
        except _LaneError as exc:
            # a message this rank cannot read is one its sender waits on: fail that peer rather than hang, if the
            # sender is who its connection authenticated as
            self.stats.dropped_malformed += 1
            if bound is not None and exc.src != bound:
                self._spoofed(exc.src, bound)
            elif 0 <= exc.src < self.world_size and exc.src != self.rank:
                self._declare_lost(exc.src, f"sent data through shared memory that this rank cannot read: {exc}")
            return
        except MessageError as exc:
            self.stats.dropped_malformed += 1
            self._malformed_log.refused(f"rank {self.rank} dropped a malformed message: {exc}")
            return
        if bound is not None and msg.src != bound:
            self._spoofed(msg.src, bound)
            return
        self._last_heard[msg.src] = time.monotonic()
        if msg.tag == TAG_CONTROL:
            lost = msg.meta.get("peer")
            if msg.meta.get("ctl") == "lost" and type(lost) is int and 0 <= lost < self.world_size:
                if lost != self.rank:
                    self._declare_lost(lost, f"was reported lost by rank {msg.src}")
            elif msg.meta.get("ctl") == "hello":
                self._take_back(msg.src, msg.meta)
            elif msg.meta.get("ctl") == "bye":
                self._said_bye.add(msg.src)
                self._declare_lost(
                    msg.src,
                    "has shut down (it called shutdown() or its process is exiting) while a message from it "
                    "was awaited",
                    expected=True,
                )
            return
        self.stats.messages_received += 1
        self.stats.bytes_received += msg.nbytes
        self._box.deliver(msg)

    def _take_back(self, peer: int, info: Mapping[str, Any]) -> None:
        """Peer ``peer`` rejoined as a new process (its ``hello``, the first message on its new link): connect to
        it afresh, forget that it was lost, and count the incarnation. Runs in the receiver thread, before any
        later message of the newcomer is handled, so nothing it sends is mistaken for its predecessor's.

        A resilient job re-forms instead (its receives broke for good when the peer was lost): ignored there.
        """
        tcp, ipc, host, pid = info.get("tcp"), info.get("ipc"), info.get("host"), info.get("pid")
        if not (
            isinstance(tcp, str)
            and tcp.startswith("tcp://")
            and isinstance(ipc, str)
            and (ipc == "" or ipc.startswith("ipc://"))
            and isinstance(host, str)
            and type(pid) is int
        ):
            self.stats.dropped_malformed += 1
            log.error("rank %d dropped a malformed hello from rank %d", self.rank, peer)
            return
        if self.resilient or self._closed or peer not in self._push:
            log.warning(
                "rank %d: rank %d rejoined, but this job re-forms rather than takes peers back", self.rank, peer
            )
            return
        if peer not in self.lost_peers():  # its death went unseen: whatever waits on the old process fails now
            self._declare_lost(peer, "was replaced by a new process (it rejoined)", expected=True)
        fresh = {"tcp": tcp, "ipc": ipc, "host": host, "pid": pid}
        sock, monitor = self._open_push(peer, fresh)
        with self._push_locks[peer]:
            old, self._push[peer] = self._push[peer], sock
            writer = self._lane_writers.pop(peer, None)  # the old process's records are never released
        if writer is not None:
            writer.close()
        old.close(linger=0)
        old_monitor = self._monitors.pop(peer, None)
        if old_monitor is not None:
            self._monitor_peer.pop(old_monitor, None)
            if self._poller is not None:
                self._poller.unregister(old_monitor)
            old_monitor.close(linger=0)
        self._monitors[peer] = monitor
        self._monitor_peer[monitor] = peer
        if self._poller is not None:
            self._poller.register(monitor, zmq.POLLIN)
        self._peer_info[peer] = fresh
        self._last_heard[peer] = time.monotonic()
        self._suspect.pop(peer, None)
        with self._linked_cond:
            self._linked.discard(peer)
        self._box.peer_back(peer)  # first: a caller that sees the incarnation may wait on the peer at once
        with self._state_lock:
            self._lost.pop(peer, None)
            self._said_bye.discard(peer)
            self._incarnations[peer] = self._incarnations.get(peer, 0) + 1
        log.info("rank %d: rank %d rejoined (pid %d); connected to it again", self.rank, peer, pid)

    def _send_control(self, dst: int, ctl: str, *, blocking_lock: bool, **fields: int) -> None:
        lock = self._push_locks[dst]
        if not lock.acquire(blocking=blocking_lock):
            return  # a data send is in progress on this link; it is as good as a heartbeat
        try:
            frames, _ = encode(self.rank, TAG_CONTROL, (), {"ctl": ctl, **fields})
            self._push[dst].send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            lock.release()

    def _run(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        monitor_peer = self._monitor_peer
        for peer, mon in self._monitors.items():
            poller.register(mon, zmq.POLLIN)
            monitor_peer[mon] = peer
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                wait_s = max(0.0, min(next_beat - now, self._grace / 2 if self._suspect else next_beat - now))
                events = dict(poller.poll(timeout=int(wait_s * 1000.0) + 1))
                if self._wake_rx in events:
                    return
                if self._pull in events:
                    for _ in range(10_000):
                        try:
                            frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle_frames(frames)
                for mon, peer in list(monitor_peer.items()):
                    if mon in events and not mon.closed:
                        while True:
                            try:
                                event = mon.recv_multipart(flags=zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            kind = int.from_bytes(event[0][:2], "little") if event and len(event[0]) == 6 else 0
                            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                                with self._linked_cond:
                                    self._linked.add(peer)
                                    self._linked_cond.notify_all()
                            elif kind == zmq.EVENT_CONNECT_RETRIED:
                                # never connected, and refused again: on this host the peer's pid says at once
                                # whether it died before anyone connected (else only the heartbeats would, in 30 s)
                                if peer not in self._linked and not self._peer_process_alive(peer):
                                    self._declare_lost(
                                        peer, "is not running: its process exited before this rank connected to it"
                                    )
                            elif kind & REFUSAL_EVENTS:
                                why = refusal_reason(kind, int.from_bytes(event[0][2:], "little"))
                                self._declare_lost(
                                    peer,
                                    f"refused this rank's connection: {why}. Every rank of a job needs the same "
                                    "PARATRAIN_SECRET",
                                )
                            elif peer not in self._said_bye:
                                self._suspect.setdefault(peer, time.monotonic())
                now = time.monotonic()
                for peer, since in list(self._suspect.items()):
                    if peer in self._said_bye:
                        del self._suspect[peer]
                    elif now - since >= self._grace:
                        del self._suspect[peer]
                        self._declare_lost(peer, "closed its connection without saying goodbye (crashed or killed)")
                if now >= next_beat:
                    next_beat = now + self._heartbeat
                    lost = self.lost_peers()
                    for peer in self._push:
                        if peer in lost:
                            continue
                        self._send_control(peer, "hb", blocking_lock=False)
                        if now - self._last_heard[peer] > self._heartbeat_timeout:
                            self._declare_lost(
                                peer,
                                f"sent nothing for {self._heartbeat_timeout:.0f}s (hung, or the network is cut)",
                            )
        except BaseException as exc:  # the receiver must never die silently: fail everything loudly
            if not self._closed:
                log.exception("rank %d: receiver thread failed", self.rank)
                self._fatal = exc
                self._box.close(TransportClosedError(f"rank {self.rank}: receiver thread failed: {exc!r}"))

    def _unread_goodbyes(self) -> set[int]:
        """The peers whose goodbye waits in the socket, unread (call with the receiver thread stopped; whatever
        else waits there is dropped, as closing would drop it)."""
        found: set[int] = set()

        def refuse(src: int, lane: Any, specs: Any) -> Any:
            raise _LaneError(src, "closing")

        while True:
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return found
            try:
                msg = decode(frames, refuse, max_frame=self._max_frame)
            except MessageError:
                continue
            if msg.tag == TAG_CONTROL and msg.meta.get("ctl") == "bye" and 0 <= msg.src < self.world_size:
                found.add(msg.src)
