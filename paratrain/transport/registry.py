"""Transports by name, as ps-lite creates its Van: ``PARATRAIN_TRANSPORT`` picks one, nothing else switches.

A :class:`TransportKind` says how to open one rank of a real job (``connect``: from the settings, e.g. ZeroMQ
through the rendezvous) and how to open every rank of a job inside this process (``local``: for tests and
in-process ranks). :func:`connect` opens the configured kind and wraps it in the fault injector when
``PARATRAIN_FAULTS`` asks for an emulated network, so the runtime and the test harness never test names
themselves. A new transport (shared memory, RDMA) registers here and becomes a valid ``PARATRAIN_TRANSPORT``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from paratrain.config import SECRET_ENV, Settings, allow_transport
from paratrain.errors import ConfigError, RendezvousError
from paratrain.transport.auth import new_secret
from paratrain.transport.base import Transport
from paratrain.transport.faults import FaultSpec, FaultyTransport
from paratrain.transport.inproc import InprocFabric
from paratrain.transport.rendezvous import RendezvousServer, admit, meet, rejoin
from paratrain.transport.zmq import ZmqTransport

__all__ = ["LocalJob", "TransportKind", "connect", "kinds", "local_job", "register_transport"]

log = logging.getLogger("paratrain.transport")


@dataclass(frozen=True, slots=True)
class LocalJob:
    """Every rank's transport of a job inside this process, and how to wake them all when one fails."""

    transports: list[Transport]
    fail_all: Callable[[BaseException], None] | None = None


@dataclass(frozen=True, slots=True)
class TransportKind:
    """A registered transport.

    Attributes:
        name: the value of ``PARATRAIN_TRANSPORT``.
        help: one line for documentation.
        connect: ``connect(settings, fabric)`` -> this rank's transport in a real job (``fabric``: the
            in-process fabric for ``inproc``, else None).
        local: ``local(world_size, timeout)`` -> every rank's transport inside this process.
    """

    name: str
    help: str
    connect: Callable[[Settings, Any], Transport]
    local: Callable[[int, float], LocalJob]


_KINDS: dict[str, TransportKind] = {}


def register_transport(kind: TransportKind) -> None:
    """Adds a transport (its name becomes a valid ``PARATRAIN_TRANSPORT``).

    Raises:
        ValueError: the name is taken.
    """
    if kind.name in _KINDS:
        raise ValueError(f"transport {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    allow_transport(kind.name)


def kinds() -> MappingProxyType[str, TransportKind]:
    """The registered transports by name."""
    return MappingProxyType(_KINDS)


def _kind(name: str) -> TransportKind:
    kind = _KINDS.get(name)
    if kind is None:
        raise ConfigError(f"unknown transport {name!r}; choose one of {', '.join(_KINDS)}")
    return kind


def connect(settings: Settings, *, fabric: object | None = None) -> Transport:
    """This rank's transport for ``settings``: the configured kind (a world of one needs no network: it is
    ``inproc`` unless a fabric says otherwise), wrapped in the fault injector if ``settings.faults``.

    Raises:
        ConfigError: unknown transport or bad fault spec. RendezvousError: the ranks could not meet.
    """
    name = "inproc" if settings.world_size == 1 and fabric is None else settings.transport
    inner = _kind(name).connect(settings, fabric)
    if not settings.faults:
        return inner
    try:
        return FaultyTransport(inner, FaultSpec.parse(settings.faults))
    except BaseException:
        inner.abort()
        raise


def local_job(name: str, world_size: int, *, timeout: float, faults: str | None = None) -> LocalJob:
    """Every rank's transport of a ``world_size`` job of kind ``name`` in this process (for tests).

    Raises:
        ConfigError: unknown transport.
    """
    job = _kind(name).local(world_size, timeout)
    if not faults:
        return job
    spec = FaultSpec.parse(faults)
    return LocalJob([FaultyTransport(t, spec) for t in job.transports], job.fail_all)


# -- inproc -----------------------------------------------------------------------------------------------------


def _connect_inproc(settings: Settings, fabric: object | None) -> Transport:
    if fabric is None:
        if settings.world_size != 1:
            raise ConfigError("transport 'inproc' with world size > 1 needs fabric=InprocFabric(world_size)")
        fabric = InprocFabric(1, timeout=settings.timeout)
    if not isinstance(fabric, InprocFabric) or fabric.world_size != settings.world_size:
        raise ConfigError(f"fabric must be an InprocFabric of world size {settings.world_size}")
    transport = fabric.transport(settings.rank)
    transport.timeout = settings.timeout
    return transport


def _local_inproc(world_size: int, timeout: float) -> LocalJob:
    fabric = InprocFabric(world_size, timeout=timeout)
    return LocalJob([fabric.transport(r) for r in range(world_size)], fabric.fail_all)


# -- zmq ----------------------------------------------------------------------------------------------------------


def zmq_transports(
    world_size: int,
    *,
    timeout: float = 30.0,
    host_ids: list[str] | None = None,
    secret: bytes | None = None,
    insecure: bool = False,
) -> list[Transport]:
    """``world_size`` connected ZeroMQ transports in this process (loopback TCP, or ipc for equal host ids).

    Their connections are authenticated with ``secret``, a fresh one if None, or not at all if ``insecure``.
    Returns once every link's handshake is complete.
    """
    hosts = host_ids or ["local"] * world_size
    if insecure and secret is not None:
        raise ValueError("give a secret or insecure=True, not both")
    job_secret = None if insecure else secret or new_secret()
    transports = [
        ZmqTransport(rank=r, world_size=world_size, host_id=hosts[r], timeout=timeout, run_id="test", secret=job_secret)
        for r in range(world_size)
    ]
    table = [t.endpoints() for t in transports]
    for t in transports:
        t.connect(table)
    for t in transports:  # so that a test's first sends are on the wire, not queued behind a handshake
        t.wait_linked(timeout)
    return list(transports)


def _local_zmq(world_size: int, timeout: float) -> LocalJob:
    return LocalJob(zmq_transports(world_size, timeout=timeout))


def _route_address(host: str) -> str:
    """The local IP address from which ``host`` is reached (no packet is sent)."""
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        raise RendezvousError(f"cannot resolve the rendezvous host {host!r}: {exc}; check MASTER_ADDR") from None
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))
        return str(probe.getsockname()[0])


def _peer_lost_reporter(settings: Settings) -> Callable[[int, str], None] | None:
    """Under ``paratrain launch``: records lost peers in the scratch directory, so that when this rank then
    fails, the launcher names the peer whose loss caused it rather than this rank."""
    scratch = settings.scratch_dir
    if scratch is None:
        return None
    path = os.path.join(scratch, f"peer-lost.{settings.rank}")
    if settings.restart_count > 0:
        # a restarted process starts a record of its own: its predecessor's losses (a peer that finished and said
        # goodbye, say) say nothing about why this process fails
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def report(peer: int, reason: str) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{peer}\t{reason}\n")

    return report


def job_secret(settings: Settings) -> bytes | None:
    """The secret this rank's connections are authenticated with; None only where the user opted out.

    Why refuse rather than run open: a job without a secret accepts registrations, messages and parameter-server
    pushes from any process that reaches a port, so it must be asked for (``PARATRAIN_INSECURE=1``), not
    fallen into by forgetting a variable on one launcher.

    Raises:
        ConfigError: neither ``PARATRAIN_SECRET`` nor ``PARATRAIN_INSECURE=1`` (with the way to set one).
    """
    if settings.secret is not None:
        if settings.insecure:
            log.warning("rank %d: PARATRAIN_INSECURE=1 is ignored: %s is set", settings.rank, SECRET_ENV)
        return settings.secret
    if settings.insecure:
        log.warning(
            "rank %d: PARATRAIN_INSECURE=1: connections are not authenticated; any process that reaches this "
            "job's ports can join it or send to its ranks",
            settings.rank,
        )
        return None
    raise ConfigError(
        f"rank {settings.rank}: no {SECRET_ENV} for a job of {settings.world_size} processes. paratrain launch "
        "sets one per job; under torchrun or SLURM give every rank the same one, e.g. "
        f'export {SECRET_ENV}=$(python -c "import secrets; print(secrets.token_hex(32))") before starting them '
        "(on a network nothing else can reach, PARATRAIN_INSECURE=1 runs without authentication)"
    )


def _connect_zmq(settings: Settings, fabric: object | None = None) -> Transport:
    """One rank of a real job: bind, meet the others at the rendezvous (rank 0 hosts it), connect."""
    secret = job_secret(settings)
    bind = settings.advertise_addr or _route_address(settings.rdzv_addr)
    zt = ZmqTransport(
        rank=settings.rank,
        world_size=settings.world_size,
        host_id=settings.host_id,
        bind_addr=bind,
        run_id=settings.run_id,
        timeout=settings.timeout,
        heartbeat=settings.heartbeat,
        heartbeat_timeout=settings.heartbeat_timeout,
        on_peer_lost=_peer_lost_reporter(settings),
        resilient=settings.resilient,
        secret=secret,
        quick_failover=settings.ps_replicas > 1,
        peers_return=settings.role == "server" and settings.ps_worker_restarts,
        lane_bytes=settings.lane_mb << 20,
        rank_bound=settings.job_workers if settings.elastic else None,
    )
    server: RendezvousServer | None = None
    try:
        if settings.elastic:
            _admit(zt, settings, secret)
            return zt
        where: dict[str, Any] = {
            "rank": settings.rank,
            "world_size": settings.world_size,
            "info": zt.endpoints(),
            "timeout": settings.rdzv_timeout,
            "secret": secret,
        }
        if _rejoins(settings):
            # a restarted parameter server: the others met long ago (as a rule); take this rank's place among them
            table, met = rejoin(settings.rdzv_addr, settings.rdzv_port, **where)
            zt.connect(table, rejoin=met)
            return zt
        if settings.rank == 0 and not settings.rdzv_hosted:
            loopback = bind == "127.0.0.1"
            server = RendezvousServer(
                world_size=settings.world_size,
                bind_addr="127.0.0.1" if loopback else "*",
                port=settings.rdzv_port,
                timeout=settings.rdzv_timeout,
                secret=secret,
            )
            server.start()
        table, zt.round = meet(settings.rdzv_addr, settings.rdzv_port, **where)
        zt.connect(table)
    except BaseException:
        zt.abort()
        raise
    finally:
        if server is not None:
            server.join(timeout=5)
    return zt


def _rejoins(settings: Settings) -> bool:
    """Whether this process replaces a lost one, which may have met the others already: a restarted parameter
    server of a replicated job (``paratrain launch --replicas R --max-restarts N``), or a restarted worker of a
    parameter-server job (``--servers S --max-restarts N``). Its transport's ``rejoined`` says whether it did (if
    the job had not met yet, the newcomer simply takes part)."""
    if settings.restart_count == 0:
        return False
    if settings.role == "server":
        return settings.ps_replicas > 1
    return settings.ps_worker_restarts and settings.num_servers > 0


def _admit(zt: ZmqTransport, settings: Settings, secret: bytes | None) -> None:
    """An elastic job's member meets the others at the launcher's rendezvous and takes the rank it is given."""
    if not settings.rdzv_hosted:
        raise ConfigError(
            "an elastic job (PARATRAIN_MIN_WORKERS) needs paratrain launch's rendezvous, which tracks who is in "
            "the job; under torchrun use its own elasticity (--nnodes MIN:MAX)"
        )
    # a joiner waits until the members next checkpoint: allow it as long as a blocking call may take
    admission = admit(
        settings.rdzv_addr,
        settings.rdzv_port,
        member=settings.member_id,
        world_size=settings.job_workers,
        info=zt.endpoints(),
        timeout=max(settings.rdzv_timeout, settings.timeout),
        secret=secret,
    )
    if admission is None:  # the caller aborts zt on the way out
        log.info("member %d: the job finished before this replacement could join; nothing to do", settings.member_id)
        raise SystemExit(0)
    zt.renumber(admission.rank, len(admission.table))
    zt.round = admission.round
    zt.connect(admission.table)


register_transport(
    TransportKind("zmq", "ZeroMQ over TCP between hosts, ipc inside one (the default)", _connect_zmq, _local_zmq)
)
register_transport(TransportKind("inproc", "threads of one process (tests)", _connect_inproc, _local_inproc))
