"""Rendezvous: every rank learns every other rank's endpoints at start-up.

A small server (a ZeroMQ ROUTER socket) collects one registration per rank — ``{rank, world_size, info}``
in msgpack, never pickle — and, once all ``world_size`` ranks have registered, answers each with the table of
everyone's ``info``. ``paratrain launch`` hosts the server itself (so no port race and no rank is special);
under torchrun or SLURM, rank 0 hosts it on ``MASTER_ADDR:PARATRAIN_RDZV_PORT`` (default ``MASTER_PORT + 1``,
since torch's own store may hold ``MASTER_PORT``).

Errors are reported, not hung on: a rank that registers twice, or with another world size, is refused with
a message; if some ranks never arrive, those that did are told which ranks are missing.

A job whose failed ranks are restarted (``paratrain launch --max-restarts``) meets more than once: the server
then serves *rounds*. Each round is complete when every rank has registered once more (the survivors after they
saw the failure, the restarted rank as it starts), and answers everyone with the new table and the round's
number. A second registration of a rank within one round replaces the first: the launcher restarts a rank only
after its process died, so the newer registration is the live one.

Given the job's secret, the server's socket is a CURVE server and each rank a CURVE client with keys derived from
it (:mod:`paratrain.transport.auth`): a process without the secret can neither register (take a rank's place in
the table, or learn the endpoints) nor make the server read a byte; each refusal is counted in
:attr:`RendezvousServer.refused` and logged (rate-limited), and :func:`register` fails at once, saying so, when the
server refuses it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import zmq

from paratrain.errors import RendezvousError
from paratrain.transport.auth import BROKEN_HANDSHAKE, REFUSAL_EVENTS, Guard, JobKeys, refusal_reason

__all__ = ["RendezvousServer", "register"]

log = logging.getLogger("paratrain.rendezvous")
_VERSION = 1


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


class RendezvousServer:
    """Collects ``world_size`` registrations and answers each with everyone's info.

    Args:
        world_size: number of ranks expected.
        bind_addr: address to listen on (``*`` for all interfaces).
        port: TCP port; 0 picks a free one (read :attr:`port` afterwards).
        timeout: seconds to wait for all ranks before telling those present who is missing (in rounds mode:
            counted from a round's first registration).
        rounds: serve round after round until closed (a job whose ranks are restarted), rather than once.
        secret: the job's secret: only ranks holding it may connect (see the module docstring). None: anyone.

    Example:
        >>> server = RendezvousServer(world_size=1, bind_addr="127.0.0.1", port=0, timeout=5)
        >>> server.start()
        >>> register("127.0.0.1", server.port, rank=0, world_size=1, info={"x": 1}, timeout=5)
        [{'x': 1}]
        >>> server.join()
    """

    def __init__(
        self,
        *,
        world_size: int,
        bind_addr: str,
        port: int,
        timeout: float,
        rounds: bool = False,
        secret: bytes | None = None,
    ) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.rounds = rounds
        #: Rounds completed so far (1 after the job first met).
        self.round = 0
        #: Ranks registered for the round being formed, and registrations accepted in all (diagnostics, tests).
        self.waiting: frozenset[int] = frozenset()
        self.accepted = 0
        #: Connections refused for want of the job's secret (always 0 without a secret).
        self.refused = 0
        self._ctx = zmq.Context(io_threads=1)
        self._guard: Guard | None = None
        keys = JobKeys.derive(secret) if secret is not None else None
        if keys is not None:
            self._guard = Guard(self._ctx, keys, name="rendezvous", on_refused=self._count_refusal)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 2000)
        if self._guard is not None and keys is not None:
            self._guard.watch(self._sock)
            keys.serve_curve(self._sock, domain="rendezvous")
            self._guard.start()
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{bind_addr}")
            else:
                self._sock.bind(f"tcp://{bind_addr}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            if self._guard is not None:
                self._guard.close()
            self._ctx.term()
            raise RendezvousError(
                f"cannot listen for rendezvous on {bind_addr}:{port}: {exc}. Another job may use this port: "
                "set MASTER_PORT or PARATRAIN_RDZV_PORT to a free one"
            ) from None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.table: list[Mapping[str, Any]] | None = None

    def _count_refusal(self) -> None:
        self.refused += 1

    def start(self) -> None:
        """Serves in a daemon thread."""
        self._thread = threading.Thread(target=self._serve, name="paratrain-rendezvous", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Waits for the server to finish (all ranks answered, or failure), then releases the socket."""
        if self._thread is not None:
            self._thread.join(timeout)
        self.close()

    def close(self) -> None:
        """Stops serving and releases the socket. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if not self._sock.closed:
            self._sock.close()
            if self._guard is not None:  # after the socket it guards
                self._guard.close()
            self._ctx.term()

    def _reply(self, ident: bytes, obj: Any) -> None:
        self._sock.send_multipart([ident, b"", _pack(obj)])

    def _serve(self) -> None:
        registered: dict[int, tuple[bytes, Mapping[str, Any]]] = {}
        deadline = time.monotonic() + self.timeout
        while not self._stop.is_set():
            if self.rounds and not registered:
                deadline = time.monotonic() + self.timeout
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(registered))
                self.error = (
                    f"rendezvous timed out after {self.timeout:.0f}s: ranks {missing} never registered "
                    f"({len(registered)} of {self.world_size} did). Did every rank start, with the same "
                    "WORLD_SIZE and MASTER_ADDR/PARATRAIN_RDZV_PORT?"
                )
                for ident, _ in registered.values():
                    self._reply(ident, {"v": _VERSION, "error": self.error})
                if self.rounds:
                    registered.clear()
                    continue
                return
            if not self._sock.poll(int(min(remaining, 0.2) * 1000) + 1):
                continue
            parts = self._sock.recv_multipart()
            if len(parts) != 3:
                log.error("rendezvous: dropped a malformed request of %d frames", len(parts))
                continue
            ident = parts[0]
            try:
                req = _unpack(parts[2])
                if not isinstance(req, dict) or req.get("v") != _VERSION:
                    raise ValueError("not a paratrain rendezvous request of this version")
                rank, world, info = req["rank"], req["world_size"], req["info"]
                if type(rank) is not int or type(world) is not int or not isinstance(info, dict):
                    raise ValueError("rank, world_size must be integers and info a map")
            except Exception as exc:
                log.error("rendezvous: dropped a malformed request: %s", exc)
                self._reply(ident, {"v": _VERSION, "error": f"malformed rendezvous request: {exc}"})
                continue
            if world != self.world_size:
                self._reply(
                    ident,
                    {
                        "v": _VERSION,
                        "error": (
                            f"rank {rank} says the world size is {world}, but the rendezvous expects "
                            f"{self.world_size}: start every rank with the same WORLD_SIZE"
                        ),
                    },
                )
                continue
            if not 0 <= rank < world:
                self._reply(ident, {"v": _VERSION, "error": f"rank {rank} outside 0..{world - 1}"})
                continue
            if rank in registered and self.rounds:
                log.warning(
                    "rendezvous: rank %d registered again (pid %s); the newer one takes part", rank, info.get("pid")
                )
            elif rank in registered:
                self._reply(
                    ident,
                    {
                        "v": _VERSION,
                        "error": (
                            f"rank {rank} registered twice (pids {registered[rank][1].get('pid')} and "
                            f"{info.get('pid')}): two processes were given the same RANK"
                        ),
                    },
                )
                continue
            registered[rank] = (ident, info)
            self.waiting = frozenset(registered)
            self.accepted += 1
            if len(registered) == self.world_size:
                table = [registered[r][1] for r in range(self.world_size)]
                self.table = table
                self.round += 1
                for ident_r, _ in registered.values():
                    self._reply(ident_r, {"v": _VERSION, "table": table, "round": self.round})
                if not self.rounds:
                    return
                registered.clear()
                self.waiting = frozenset()


#: Handshakes dropped in a row before :func:`register` concludes that the server refuses its keys (one dropped
#: handshake may be a server going down; three, 0.1 s apart, are a server that drops this rank's keys).
_BROKEN_HANDSHAKES = 3


def register(
    addr: str,
    port: int,
    *,
    rank: int,
    world_size: int,
    info: Mapping[str, Any],
    timeout: float,
    secret: bytes | None = None,
) -> list[dict[str, Any]]:
    """Registers this rank's ``info`` and blocks until everyone's arrives (or ``timeout``).

    Args:
        secret: the job's secret (the server's must be the same), or None to connect unauthenticated.

    Returns:
        The info of every rank, indexed by rank.

    Raises:
        RendezvousError: refused by the server (also for want of the server's secret: at once, not after
            ``timeout``), or no complete table within ``timeout`` seconds.
    """
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"tcp://{addr}:{port}"
    monitor = sock.get_monitor_socket(REFUSAL_EVENTS | BROKEN_HANDSHAKE)
    try:
        if secret is not None:
            JobKeys.derive(secret).authenticate_client(sock, address)
        sock.connect(address)
        sock.send_multipart([b"", _pack({"v": _VERSION, "rank": rank, "world_size": world_size, "info": dict(info)})])
        _await_answer(sock, monitor, rank=rank, world_size=world_size, where=f"{addr}:{port}", timeout=timeout)
        parts = sock.recv_multipart()
        try:
            reply = _unpack(parts[-1])
        except Exception as exc:
            raise RendezvousError(f"rank {rank}: malformed rendezvous reply ({exc})") from None
        if not isinstance(reply, dict):
            raise RendezvousError(f"rank {rank}: malformed rendezvous reply")
        if "error" in reply:
            raise RendezvousError(f"rank {rank}: {reply['error']}")
        table = reply.get("table")
        if not isinstance(table, list) or len(table) != world_size or not all(isinstance(t, dict) for t in table):
            raise RendezvousError(f"rank {rank}: rendezvous reply lacks a table of {world_size} entries")
        return table
    finally:
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def _await_answer(
    sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], *, rank: int, world_size: int, where: str, timeout: float
) -> None:
    """Blocks until the server's answer is readable on ``sock``; raises if it refuses the handshake or is silent."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    broken = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousError(
                f"rank {rank}: no answer from the rendezvous at {where} within {timeout:.0f}s. Are all "
                f"{world_size} ranks started, and is {where.rsplit(':', 1)[0]} reachable from this host? (raise "
                "PARATRAIN_RDZV_TIMEOUT if ranks start slowly)"
            )
        events = dict(poller.poll(int(remaining * 1000) + 1))
        if sock in events:
            return
        if monitor not in events:
            continue
        frames = monitor.recv_multipart()
        if len(frames) != 2 or len(frames[0]) != 6:
            continue
        event, value = int.from_bytes(frames[0][:2], "little"), int.from_bytes(frames[0][2:], "little")
        broken = broken + 1 if event & BROKEN_HANDSHAKE else broken
        if event & REFUSAL_EVENTS or broken >= _BROKEN_HANDSHAKES:
            raise RendezvousError(
                f"rank {rank}: the rendezvous at {where} refused this rank: {refusal_reason(event, value)}. Every "
                "rank needs the job's PARATRAIN_SECRET (paratrain launch sets it; under torchrun or SLURM export "
                "the same value on every rank)"
            )
