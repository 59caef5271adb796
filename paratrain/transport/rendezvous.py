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

An *elastic* job (``paratrain launch --min-workers``) also changes who takes part. Each process registers under
its *member* id (the rank it was launched as, which never changes); the server keeps the list of members, the
launcher removes one that died for good (:meth:`RendezvousServer.remove`), and a process whose member id is not
on the list is a *joiner*: it waits until the members next meet, and is admitted then. A round is complete when
every member has registered, and its answer renumbers everyone: ranks ``0..W-1`` in member order, so that a
rank that rejoins gets its old rank back once everyone has. :func:`admit` is the member's side.

A job whose parameter servers are restarted (``paratrain launch --servers S --replicas R --max-restarts N``)
meets once, but the server stays up (``rejoins``): a restarted process registers with ``rejoin`` and is answered
at once with the job's table (its own entry replaced), connects to everyone and announces itself
(:meth:`~paratrain.transport.zmq.ZmqTransport.connect`); the others do not meet again.

Given the job's secret, the server's socket is a CURVE server and each rank a CURVE client with keys derived from
it (:mod:`paratrain.transport.auth`): a process without the secret can neither register (take a rank's place in
the table, or learn the endpoints); each refusal is counted in :attr:`RendezvousServer.refused` and logged
(rate-limited), and :func:`register` fails at once, saying so, when the server refuses it. The others are told
too: a round that misses no more ranks than connections were refused while it formed, and then sees nothing for
:data:`REFUSAL_QUIET_S`, fails every registered rank with "rank K presented another secret" instead of waiting out
its timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from paratrain.errors import JobOverError, RendezvousError
from paratrain.transport.auth import BROKEN_HANDSHAKE, REFUSAL_EVENTS, Guard, JobKeys, refusal_reason

__all__ = ["Admission", "RendezvousServer", "admit", "meet", "register", "rejoin"]

log = logging.getLogger("paratrain.rendezvous")
_VERSION = 1

#: The longest registration the server reads (a rank's endpoints and host: well under a KiB in practice).
MAX_REQUEST_BYTES = 1 << 20

#: Seconds without a registration or a refusal after which a round that misses only as many ranks as connections
#: were refused while it formed fails everyone (those ranks hold another secret), rather than the whole timeout.
REFUSAL_QUIET_S = 2.0


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
        elastic: (with ``rounds``) registrations name members, the membership changes (see the module docstring).
        on_joiner: (elastic) called with the round a joiner will be admitted in, when one registers; the
            launcher uses it to tell the members (they look at their next checkpoint).
        rejoins: (not with ``rounds``) keep serving after the job met: a rank that registers with ``rejoin`` is
            answered at once with the table, its entry replaced (see the module docstring).
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
        elastic: bool = False,
        on_joiner: Callable[[int], None] | None = None,
        secret: bytes | None = None,
        rejoins: bool = False,
    ) -> None:
        if elastic and not rounds:
            raise ValueError("an elastic rendezvous serves rounds")
        if rejoins and rounds:
            raise ValueError("a rendezvous serves rounds or rejoins, not both")
        self.rejoins = rejoins
        self.world_size = world_size
        self.timeout = timeout
        self.rounds = rounds
        self.elastic = elastic
        self._on_joiner = on_joiner
        self._members_lock = threading.Lock()
        self._members = list(range(world_size))
        self._purge: set[int] = set()
        self._finished: set[int] = set()
        #: Rounds completed so far (1 after the job first met).
        self.round = 0
        #: Ranks registered for the round being formed, and registrations accepted in all (diagnostics, tests).
        self.waiting: frozenset[int] = frozenset()
        self.accepted = 0
        #: Connections refused for want of the job's secret (always 0 without a secret).
        self.refused = 0
        # refusals while the round being formed waits (Guard thread -> serving thread, under _members_lock)
        self._forming_refusals = 0
        self._last_event = time.monotonic()  # the last registration or refusal
        self._ctx = zmq.Context(io_threads=1)
        self._guard: Guard | None = None
        keys = JobKeys.derive(secret) if secret is not None else None
        if keys is not None:
            self._guard = Guard(self._ctx, keys, name="rendezvous", on_refused=self._count_refusal)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 2000)
        JobKeys.limit_strangers(self._sock, max_frame=MAX_REQUEST_BYTES)
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
        # remove() wakes the serving thread through this pair (a ZeroMQ socket is used by one thread at a time:
        # the sending end only under _members_lock)
        self._wake_addr = f"inproc://rendezvous-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.table: list[Mapping[str, Any]] | None = None

    def _count_refusal(self) -> None:
        self.refused += 1
        with self._members_lock:
            self._forming_refusals += 1
            self._last_event = time.monotonic()

    @property
    def members(self) -> list[int]:
        """The member ids of the job as it stands (elastic: after removals and admissions), in rank order."""
        with self._members_lock:
            return list(self._members)

    def remove(self, member: int) -> bool:
        """Takes ``member`` out of the job for good (it died and will not come back as itself); the members'
        next round completes without it. False if it was not a member.
        """
        with self._members_lock:
            if member not in self._members:
                return False
            self._members.remove(member)
            self._purge.add(member)  # its registration for a round being formed came from the dead process
            if not self._wake_tx.closed:
                self._wake_tx.send(b"", zmq.NOBLOCK)
        log.info("rendezvous: member %d removed; the job goes on with %d", member, len(self._members))
        return True

    def finish(self, member: int) -> None:
        """``member`` completed its work (its process exited 0). Once every member has (elastic), or any member
        has (a fixed-size job, which cannot meet again without it), the job is over: a joiner or restarted rank
        still waiting, or registering later, is told so (:func:`admit` then returns None, :func:`register`
        raises)."""
        with self._members_lock:
            self._finished.add(member)
            if not self._wake_tx.closed:
                self._wake_tx.send(b"", zmq.NOBLOCK)

    @property
    def over(self) -> bool:
        """True once every member of an elastic job, or any member of a fixed-size one, has finished (see
        :meth:`finish`)."""
        with self._members_lock:
            if self.elastic:
                return bool(self._members) and set(self._members) <= self._finished
            return self.rounds and bool(self._finished)

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
            with self._members_lock:
                self._wake_tx.close(linger=0)
            self._wake_rx.close(linger=0)
            if self._guard is not None:  # after the socket it guards
                self._guard.close()
            self._ctx.term()

    def _reply(self, ident: bytes, obj: Any) -> None:
        self._sock.send_multipart([ident, b"", _pack(obj)])

    def _serve(self) -> None:
        registered: dict[int, tuple[bytes, Mapping[str, Any]]] = {}
        deadline = time.monotonic() + self.timeout
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            self._drop_removed(registered)
            members = self.members
            if self.over and registered:  # joiners waiting for a job that has ended
                for ident, _ in registered.values():
                    self._reply(ident, {"v": _VERSION, "over": True})
                registered.clear()
                self.waiting = frozenset()
            if self.rounds and not registered.keys() & set(members):
                deadline = time.monotonic() + self.timeout  # a round starts with its first member (not a joiner)
            if registered and set(members) <= registered.keys() and registered.keys() & set(members):
                if not self._complete(registered, members):
                    continue  # a member was removed meanwhile: look again without it
                if not self.rounds and not self.rejoins:
                    return
                registered.clear()
                self.waiting = frozenset()
                continue
            if self._refused_ranks(registered, members):
                if self.rounds:
                    continue
                return
            remaining = deadline - time.monotonic()
            if self.table is not None and self.rejoins:
                remaining = 3600.0  # the job met: only rejoins are served, for as long as it runs
            if remaining <= 0:
                self._time_out(registered, members)
                if self.rounds:
                    continue
                return
            events = dict(poller.poll(int(min(remaining, 0.2) * 1000) + 1))
            if self._wake_rx in events:
                self._wake_rx.recv()
            if self._sock not in events:
                continue
            parts = self._sock.recv_multipart()
            if len(parts) != 3:
                log.error("rendezvous: dropped a malformed request of %d frames", len(parts))
                continue
            self._accept(parts[0], parts[2], registered, members)

    def _drop_removed(self, registered: dict[int, tuple[bytes, Mapping[str, Any]]]) -> None:
        """Forgets registrations of members removed since (a dead process's): a round must not admit them."""
        with self._members_lock:
            purge, self._purge = self._purge, set()
        for member in purge:
            if registered.pop(member, None) is not None:
                log.info("rendezvous: dropped the registration of removed member %d", member)
        self.waiting = frozenset(registered)

    def _refused_ranks(self, registered: dict[int, tuple[bytes, Mapping[str, Any]]], members: list[int]) -> bool:
        """Fails the round being formed when its missing ranks are no more than the connections refused meanwhile
        and nothing happened for :data:`REFUSAL_QUIET_S`: those ranks hold another secret (a rank refused fails at
        once; the others would otherwise wait the whole timeout). Answers every registered rank; True if it did."""
        with self._members_lock:
            refusals, quiet = self._forming_refusals, time.monotonic() - self._last_event
        present = registered.keys() & set(members)
        missing = sorted(set(members) - present)
        if not refusals or not present or not missing or len(missing) > refusals or quiet < REFUSAL_QUIET_S:
            return False
        with self._members_lock:
            self._forming_refusals = 0
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        self.error = (
            f"{who} presented another secret: the rendezvous refused {refusals} connection(s) without this job's "
            f"PARATRAIN_SECRET while {who} never registered ({len(present)} of {len(members)} did). Give every rank "
            "the same PARATRAIN_SECRET (paratrain launch makes one per job)"
        )
        log.error("rendezvous: %s", self.error)
        self._fail_registered(registered, members)
        self.waiting = frozenset(registered)
        return True

    def _time_out(self, registered: dict[int, tuple[bytes, Mapping[str, Any]]], members: list[int]) -> None:
        missing = sorted(set(members) - set(registered))
        self.error = (
            f"rendezvous timed out after {self.timeout:.0f}s: ranks {missing} never registered "
            f"({len(registered.keys() & set(members))} of {len(members)} did). Did every rank start, with the same "
            "WORLD_SIZE and MASTER_ADDR/PARATRAIN_RDZV_PORT?"
        )
        self._fail_registered(registered, members)

    def _fail_registered(self, registered: dict[int, tuple[bytes, Mapping[str, Any]]], members: list[int]) -> None:
        """Answers the round's registered ranks (in rounds, its members only) with :attr:`error`."""
        for member in [m for m in registered if m in members or not self.rounds]:
            self._reply(registered.pop(member)[0], {"v": _VERSION, "error": self.error})

    def _complete(self, registered: dict[int, tuple[bytes, Mapping[str, Any]]], members: list[int]) -> bool:
        """Answers a complete round: the table in member order, with joiners admitted (elastic). False (nothing
        answered) when a member was removed since ``members`` was read."""
        admitted = sorted(registered) if self.elastic else members
        with self._members_lock:
            if self._purge:  # a member was removed meanwhile: do not re-admit its dead registration
                return False
            self._members = list(admitted)
            self._forming_refusals = 0  # the next round counts its own
        table = [registered[m][1] for m in admitted]
        self.table = table
        self.round += 1
        for rank, member in enumerate(admitted):
            answer = {"v": _VERSION, "table": table, "round": self.round, "rank": rank, "members": admitted}
            self._reply(registered[member][0], answer)
        if len(admitted) != len(members):
            log.info(
                "rendezvous: round %d admits %s; members now %s",
                self.round,
                sorted(set(admitted) - set(members)),
                admitted,
            )
        return True

    def _accept(
        self, ident: bytes, body: bytes, registered: dict[int, tuple[bytes, Mapping[str, Any]]], members: list[int]
    ) -> None:
        """Records one registration, or answers it with why it is refused."""
        try:
            req = _unpack(body)
            if not isinstance(req, dict) or req.get("v") != _VERSION:
                raise ValueError("not a paratrain rendezvous request of this version")
            rank, world, info = req["rank"], req["world_size"], req["info"]
            if type(rank) is not int or type(world) is not int or not isinstance(info, dict):
                raise ValueError("rank, world_size must be integers and info a map")
        except Exception as exc:
            log.error("rendezvous: dropped a malformed request: %s", exc)
            self._reply(ident, {"v": _VERSION, "error": f"malformed rendezvous request: {exc}"})
            return
        if bool(req.get("elastic")) != self.elastic:
            mode = "an elastic" if self.elastic else "a fixed-size"
            self._reply(ident, {"v": _VERSION, "error": f"rank {rank} does not know that this is {mode} job"})
            return
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
            return
        if not 0 <= rank < world:
            self._reply(ident, {"v": _VERSION, "error": f"rank {rank} outside 0..{world - 1}"})
            return
        if req.get("rejoin") is True and self.rejoins and self.table is not None:
            table = list(self.table)
            table[rank] = info
            self.table = table
            self.accepted += 1
            log.info("rendezvous: rank %d rejoined (pid %s)", rank, info.get("pid"))
            self._reply(ident, {"v": _VERSION, "table": table, "round": self.round, "rejoined": True})
            return
        if self.table is not None and self.rejoins:
            self._reply(
                ident,
                {
                    "v": _VERSION,
                    "error": f"rank {rank} registered after the job met; only a restarted "
                    "rank may rejoin (PARATRAIN_RESTART_COUNT above 0)",
                },
            )
            return
        if rank in registered and (self.rounds or req.get("rejoin") is True):
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
            return
        if self.over:
            self._reply(ident, {"v": _VERSION, "over": True})
            return
        self._drop_removed(registered)  # before this registration: it may be a removed member's replacement
        with self._members_lock:
            self._last_event = time.monotonic()
        registered[rank] = (ident, info)
        self.waiting = frozenset(registered)
        self.accepted += 1
        if self.elastic and rank not in members:
            log.info("rendezvous: member %d waits to join (round %d)", rank, self.round + 1)
            if self._on_joiner is not None:
                self._on_joiner(self.round + 1)


#: Handshakes dropped in a row before :func:`register` concludes that the server refuses its keys (one dropped
#: handshake may be a server going down; three, 0.1 s apart, are a server that drops this rank's keys).
_BROKEN_HANDSHAKES = 3


@dataclass(frozen=True, slots=True)
class Admission:
    """A member's place in the job as a rendezvous round formed it.

    Attributes:
        table: every rank's info, indexed by rank.
        rank: this process's rank in it.
        round: the round's number (1 when the job first met).
        members: the member id of every rank.
    """

    table: list[dict[str, Any]]
    rank: int
    round: int
    members: list[int]


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
    return meet(addr, port, rank=rank, world_size=world_size, info=info, timeout=timeout, secret=secret)[0]


def meet(
    addr: str,
    port: int,
    *,
    rank: int,
    world_size: int,
    info: Mapping[str, Any],
    timeout: float,
    secret: bytes | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """:func:`register`, and the number of the round that formed the job (1: its first meeting; 0 from a server
    that does not count rounds). A restarted rank needs it: in round 1 it took its predecessor's place before the
    job met, so nobody holds state to catch up from and it starts afresh, as the others do.

    Raises:
        RendezvousError: as :func:`register`.
    """
    reply = _request(addr, port, rank=rank, world_size=world_size, info=info, timeout=timeout, secret=secret)
    if reply.get("over") is True:
        raise JobOverError(
            f"rank {rank}: the job is over: another rank finished its work before this one could meet it (a rank "
            "restarted after the others' last collective has nothing to rejoin); the others' results stand"
        )
    round_ = reply.get("round")
    return _table(reply, rank=rank, world_size=world_size), round_ if type(round_) is int else 0


def rejoin(
    addr: str,
    port: int,
    *,
    rank: int,
    world_size: int,
    info: Mapping[str, Any],
    timeout: float,
    secret: bytes | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """:func:`register` for a restarted rank: answered at once if the job met already (a ``rejoins`` server).

    Returns:
        The table, and whether the job had met: False when the rank died and came back before everyone arrived
        (it then simply takes part in the first meeting, as if it had never died).

    Raises:
        RendezvousError: as :func:`register`.
    """
    reply = _request(
        addr, port, rank=rank, world_size=world_size, info=info, timeout=timeout, secret=secret, rejoin=True
    )
    return _table(reply, rank=rank, world_size=world_size), reply.get("rejoined") is True


def _table(reply: Mapping[str, Any], *, rank: int, world_size: int) -> list[dict[str, Any]]:
    table = reply.get("table")
    if not isinstance(table, list) or len(table) != world_size or not all(isinstance(t, dict) for t in table):
        raise RendezvousError(f"rank {rank}: rendezvous reply lacks a table of {world_size} entries")
    return table


def admit(
    addr: str,
    port: int,
    *,
    member: int,
    world_size: int,
    info: Mapping[str, Any],
    timeout: float,
    secret: bytes | None = None,
) -> Admission | None:
    """:func:`register` for a member of an elastic job: blocks until a round admits it, and says where.

    ``world_size`` is the size the job was launched with (every process's the same); the round's may be smaller.

    Returns:
        Where the round placed this member, or None when the job's members have all finished meanwhile (a
        replacement that was not needed in the end).

    Raises:
        RendezvousError: as :func:`register`.
    """
    reply = _request(
        addr, port, rank=member, world_size=world_size, info=info, timeout=timeout, secret=secret, elastic=True
    )
    if reply.get("over") is True:
        return None
    table, rank, rnd, members = reply.get("table"), reply.get("rank"), reply.get("round"), reply.get("members")
    if (
        not isinstance(table, list)
        or not all(isinstance(t, dict) for t in table)
        or not isinstance(members, list)
        or len(members) != len(table)
        or type(rank) is not int
        or not 0 <= rank < len(table)
        or members[rank] != member
        or type(rnd) is not int
    ):
        raise RendezvousError(f"member {member}: malformed elastic rendezvous reply")
    return Admission(table, rank, rnd, [int(m) for m in members])


def _request(
    addr: str,
    port: int,
    *,
    rank: int,
    world_size: int,
    info: Mapping[str, Any],
    timeout: float,
    secret: bytes | None,
    elastic: bool = False,
    rejoin: bool = False,
) -> dict[str, Any]:
    """One registration and the server's answer (a map without ``error``)."""
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"tcp://{addr}:{port}"
    monitor = sock.get_monitor_socket(REFUSAL_EVENTS | BROKEN_HANDSHAKE)
    request: dict[str, Any] = {"v": _VERSION, "rank": rank, "world_size": world_size, "info": dict(info)}
    if elastic:
        request["elastic"] = True
    if rejoin:
        request["rejoin"] = True
    try:
        if secret is not None:
            JobKeys.derive(secret).authenticate_client(sock, address)
        sock.connect(address)
        sock.send_multipart([b"", _pack(request)])
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
        return reply
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
