"""Every setting and environment variable paratrain reads, in one place.

Settings come from the environment that a launcher sets: ``paratrain launch``, ``torchrun`` (torch elastic) or
SLURM's ``srun``. :meth:`Settings.from_env` takes the environment as a mapping, so tests inject one instead of
touching ``os.environ``. Nothing else in paratrain reads ``os.environ`` for these names. (One module, about 530
lines, most of it this table and the validation of each field: one place to look up any setting.)

Variables (all optional unless a launcher set them):

==============================  ==================================================================================
``RANK`` / ``WORLD_SIZE``       this process's rank and the number of processes (torchrun, ``paratrain launch``)
``LOCAL_RANK`` ...              ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: rank and count on this host
``MASTER_ADDR``/``MASTER_PORT`` host of rank 0 and torch's store port; paratrain's rendezvous uses
                                ``MASTER_PORT + 1`` unless ``PARATRAIN_RDZV_PORT`` says otherwise
``SLURM_PROCID`` ...            ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``
                                and ``SLURM_JOB_NODELIST`` stand in for the above under ``srun``
``PARATRAIN_TRANSPORT``         ``zmq`` (default) or ``inproc``
``PARATRAIN_RDZV_ADDR``         rendezvous host (default ``MASTER_ADDR``)
``PARATRAIN_RDZV_PORT``         rendezvous port (default ``MASTER_PORT + 1``; ``paratrain launch`` sets it)
``PARATRAIN_ADDR``              address this rank advertises to others (default: the interface that routes to
                                the rendezvous host)
``PARATRAIN_HOST_ID``           ranks with equal host ids talk over ipc/shared memory (default: hostname, boot id
                                and network namespace, so network namespaces count as separate hosts)
``PARATRAIN_TIMEOUT``           default timeout in seconds of blocking calls (300)
``PARATRAIN_RDZV_TIMEOUT``      seconds to wait for all ranks at start-up (120)
``PARATRAIN_HEARTBEAT``         seconds between heartbeats (1.0)
``PARATRAIN_HEARTBEAT_TIMEOUT`` seconds of silence after which a peer is declared lost (30)
``PARATRAIN_SHM_LANE_MB``       MiB of the shared-memory lane to each peer on this host that bulk messages go
                                through instead of the ipc socket (64; 0: off)
``PARATRAIN_FAULTS``            wrap the transport in the fault injector, e.g. ``latency=2ms,bandwidth=100Mbit``
``PARATRAIN_ROLE``              ``worker`` (default) or ``server`` (set by ``paratrain launch --servers``)
``PARATRAIN_NUM_SERVERS``       set by ``paratrain launch --servers S``: S parameter servers *besides* the
                                ``WORLD_SIZE`` workers; a server's ``RANK`` is its index among the servers
``PARATRAIN_SERVERS``           under torchrun or SLURM: the last S of the ``WORLD_SIZE`` processes are
                                parameter servers (their ``paratrain.init()`` serves, then exits)
``PARATRAIN_PS_REPLICAS``       set by ``paratrain launch --replicas R``: every parameter-server chunk lives on R
                                servers (primary-backup); a job survives R - 1 server deaths (default 1)
``PARATRAIN_PS_WORKER_RESTARTS`` set by ``paratrain launch --servers S --max-restarts R``: a dead worker's place is held
                                on the servers and its replacement rejoins there (:mod:`paratrain.ps.rejoin`)
``PARATRAIN_RUN_ID``            identifies the job (names of ipc endpoints and shared memory)
``PARATRAIN_RUN_DIR``           directory for the job's outputs (metrics, plots, timeline)
``PARATRAIN_TIMELINE``          write a Horovod-style Chrome-trace timeline of this process's communication to
                                this file (rank r > 0: ``NAME.rank{r}.json``; :mod:`paratrain.timeline`)
``PARATRAIN_SCRATCH_DIR``       the launcher's scratch directory for this job (removed when the job ends)
``PARATRAIN_LOG_LEVEL``         logging level of the ``paratrain`` logger (``WARNING``)
``PARATRAIN_MAX_RESTARTS``      set by ``paratrain launch --max-restarts R``: a failed rank is restarted (up to R
                                times in all) and the job goes on; any peer's crash then breaks every pending
                                receive at once, so that the survivors start recovery (:mod:`paratrain.recovery`)
``PARATRAIN_RESTART_COUNT``     how many times this rank's process has been restarted (0: the first one)
``PARATRAIN_MIN_WORKERS``       set by ``paratrain launch --min-workers M``: the job is elastic: a worker that dies
                                with no warm spare ready is dropped while M remain, a replacement joins later;
                                ranks are renumbered (``RANK`` stays the process's member id)
``PARATRAIN_SECRET``            the job's secret, in hex (at least 16 bytes; ``paratrain launch`` makes 32 random
                                bytes per job): every connection (rendezvous, workers, parameter servers) is
                                authenticated with keys derived from it (:mod:`paratrain.transport.auth`). Under
                                torchrun or SLURM, give every rank the same one; a job of several processes
                                without one refuses to start
``PARATRAIN_INSECURE``          ``1``: run a job of several processes without a secret, unauthenticated (only on a
                                network nothing else can reach; saves CURVE's cost on TCP, see the module above)
==============================  ==================================================================================
"""

from __future__ import annotations

import binascii
import contextlib
import dataclasses
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from paratrain.errors import ConfigError

__all__ = [
    "DEFAULT_MASTER_PORT",
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "Settings",
    "first_host_of_nodelist",
    "host_id",
    "parse_duration",
    "parse_secret",
]

DEFAULT_MASTER_PORT = 29500
#: The environment variable that carries the job's secret, in hex.
SECRET_ENV = "PARATRAIN_SECRET"
#: The shortest secret accepted: 128 bits, out of reach of guessing.
MIN_SECRET_BYTES = 16
#: Accepted ``PARATRAIN_TRANSPORT`` values: the built-ins, and whatever :mod:`paratrain.transport.registry`
#: registers (it tells this module through :func:`allow_transport`).
_TRANSPORTS = ["zmq", "inproc"]


def allow_transport(name: str) -> None:
    """Accepts ``name`` as a transport (called by the transport registry for each kind it registers)."""
    if name not in _TRANSPORTS:
        _TRANSPORTS.append(name)


_ROLES = ("worker", "server")


def _get_opt_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _get_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = _get_opt_int(env, name)
    return default if value is None else value


def _get_flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"environment variable {name}={raw!r} must be 1 or 0")
    return raw == "1"


def _get_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse_duration(raw)
    except ConfigError as exc:
        raise ConfigError(f"environment variable {name}: {exc}") from None
    if value <= 0:
        raise ConfigError(f"environment variable {name}={raw!r} must be positive")
    return value


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|µs|ms|s|m|min|h)?\s*$")
_DURATION_UNITS = {
    None: 1.0,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
}


def parse_duration(text: str) -> float:
    """Parses ``"2ms"``, ``"1.5s"``, ``"300"`` (seconds) into seconds.

    Example:
        >>> parse_duration("2ms")
        0.002
    """
    match = _DURATION.match(text)
    if match is None:
        raise ConfigError(f"{text!r} is not a duration; write e.g. 30, 2.5s, 2ms or 500us")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def parse_secret(text: str, *, name: str = SECRET_ENV) -> bytes:
    """The job's secret written as hex (``PARATRAIN_SECRET``).

    Raises:
        ConfigError: not hex, or shorter than :data:`MIN_SECRET_BYTES` bytes.

    Example:
        >>> len(parse_secret("00" * 32))
        32
    """
    how = 'make one with: python -c "import secrets; print(secrets.token_hex(32))" and give every rank the same'
    try:
        secret = binascii.unhexlify(text.strip())
    except (binascii.Error, ValueError):
        raise ConfigError(f"{name} is not hex; {how}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{name} has {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}; {how}")
    return secret


def first_host_of_nodelist(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``node[07-10,12],gpu3``.

    SLURM gives the hosts of a job in a compressed form; rank 0 runs on the first one, which is where the
    rendezvous is hosted when ``MASTER_ADDR`` is not set.

    Example:
        >>> first_host_of_nodelist("node[07-10,12],gpu3")
        'node07'
    """
    text = nodelist.strip()
    if not text:
        raise ConfigError("SLURM_JOB_NODELIST is empty; set MASTER_ADDR to the host of rank 0")
    depth = 0
    end = len(text)
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            end = i
            break
    first = text[:end]
    match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", first)
    if match is None:
        if "[" in first or "]" in first:
            raise ConfigError(f"cannot parse SLURM node list {nodelist!r}; set MASTER_ADDR explicitly")
        return first
    prefix, ranges, suffix = match.groups()
    first_range = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first_range}{suffix}"


def host_id(env: Mapping[str, str]) -> str:
    """An identifier equal for processes that can share memory and ipc sockets, distinct otherwise.

    Hostname alone is not enough: network namespaces used to emulate a cluster on one machine share the
    hostname but not abstract ipc sockets, so the namespace's inode is part of the id.
    """
    explicit = env.get("PARATRAIN_HOST_ID")
    if explicit:
        return explicit
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            parts.append(fh.read().strip())
    except OSError:
        pass
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/net"))
    return "|".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The resolved configuration of one process.

    Attributes:
        rank: this process's global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job (workers and servers).
        local_rank: rank among the processes of this host.
        local_world_size: number of processes on this host.
        master_addr: host of rank 0.
        master_port: torch's store port on ``master_addr``; paratrain does not bind it.
        rdzv_addr: where paratrain's rendezvous listens.
        rdzv_port: port of paratrain's rendezvous.
        rdzv_hosted: True when the launcher hosts the rendezvous (otherwise rank 0 does).
        advertise_addr: address other ranks use to reach this one; None to derive it.
        host_id: ranks with equal ids share a host (ipc and shared memory between them).
        transport: transport name (``zmq`` or ``inproc``).
        timeout: default timeout (s) of blocking calls. Large enough for the slowest legitimate wait in your
            job (a straggler's step, a checkpoint), small enough that a hang surfaces as an error.
        rdzv_timeout: seconds to wait for every rank at start-up.
        heartbeat: seconds between heartbeats. Smaller detects silent deaths sooner at the cost of traffic.
        heartbeat_timeout: seconds of silence before a peer is declared lost. Crashed processes are usually
            detected at once from their closed connection; this covers hung hosts and cut networks.
        lane_mb: MiB of the shared-memory lane to each same-host peer (:mod:`paratrain.transport.lane`); 0: off.
        faults: fault-injection spec for the transport (see :mod:`paratrain.transport.faults`), or None.
        role: ``worker`` or ``server``.
        num_servers: parameter-server processes in the job. Ranks ``0..world_size - num_servers - 1`` are
            the workers, the last ``num_servers`` ranks the servers; ``rank`` and ``world_size`` count both
            (they are the transport's), while :attr:`num_workers` and :attr:`role_rank` count one role.
        ps_replicas: servers holding each parameter-server chunk (``KVStore``'s default ``replicas``); 2 or
            more survive server deaths at the cost of a server-to-server hop per push.
        ps_worker_restarts: the launcher restarts dead workers of this parameter-server job: the servers hold a
            dead worker's place (its clock, its pushes of the interrupted clock) until its replacement rejoins.
        run_id: identifier of the job, used to name ipc endpoints and shared memory.
        run_dir: directory for outputs, or None.
        timeline: the file of the communication timeline (``PARATRAIN_TIMELINE``), or None.
        scratch_dir: the launcher's per-job scratch directory, or None when not under ``paratrain launch``.
        launched_by: ``paratrain``, ``torchrun``, ``slurm`` or ``none`` (a single process started by hand).
        max_restarts: restarts the launcher may still make in this job (``paratrain launch --max-restarts``);
            above 0 the job is *resilient*: a crashed peer fails every pending receive, not only those from it.
        restart_count: how many times this rank's process was restarted; above 0 this process replaces a
            crashed one and must recover its state from the survivors (:mod:`paratrain.recovery`).
        min_workers: above 0 the job is *elastic* (``paratrain launch --min-workers``): a worker that dies for
            good (no restart left, or none ready) is dropped and the others go on while at least this many remain;
            a replacement joins later. Ranks are then renumbered: :attr:`member` is the stable identity.
        member: this process's member id in an elastic job, the rank it was launched as (never changes, while
            :attr:`rank` and :attr:`world_size` describe the job as it stands); None: equal to ``rank``.
        launched_workers: the workers the job was launched with (``WORLD_SIZE``), which an elastic job keeps as
            its number of data shards whatever its size; 0: equal to ``world_size``.
        secret: the job's secret; every connection is authenticated with keys derived from it. Not shown by
            ``repr``. None: a multi-process ZeroMQ job refuses to start unless :attr:`insecure`.
        insecure: run without a secret, unauthenticated (``PARATRAIN_INSECURE=1``); ignored when a secret is set.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    rdzv_addr: str = "127.0.0.1"
    rdzv_port: int = DEFAULT_MASTER_PORT + 1
    rdzv_hosted: bool = False
    advertise_addr: str | None = None
    host_id: str = ""
    transport: str = "zmq"
    timeout: float = 300.0
    rdzv_timeout: float = 120.0
    heartbeat: float = 1.0
    heartbeat_timeout: float = 30.0
    lane_mb: int = 64
    faults: str | None = None
    role: str = "worker"
    num_servers: int = 0
    ps_replicas: int = 1
    ps_worker_restarts: bool = False
    run_id: str = "default"
    run_dir: str | None = None
    timeline: str | None = None
    scratch_dir: str | None = None
    launched_by: str = "none"
    max_restarts: int = 0
    restart_count: int = 0
    min_workers: int = 0
    member: int | None = None
    launched_workers: int = 0
    secret: bytes | None = field(default=None, repr=False)
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1} (world size {self.world_size})")
        if not 0 <= self.lane_mb <= 1 << 16:
            raise ConfigError(f"PARATRAIN_SHM_LANE_MB={self.lane_mb} must be 0 (off) .. 65536 MiB")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"local rank {self.local_rank} is outside 0..{self.local_world_size - 1} "
                f"(local world size {self.local_world_size})"
            )
        if self.transport not in _TRANSPORTS:
            raise ConfigError(f"unknown transport {self.transport!r}; choose one of {', '.join(_TRANSPORTS)}")
        if self.role not in _ROLES:
            raise ConfigError(f"unknown role {self.role!r}; choose one of {', '.join(_ROLES)}")
        if not 0 <= self.num_servers < self.world_size:
            raise ConfigError(
                f"{self.num_servers} servers leave no worker in a job of {self.world_size} processes; "
                "a job needs at least one worker"
            )
        if self.ps_replicas < 1 or (self.num_servers and self.ps_replicas > self.num_servers):
            raise ConfigError(
                f"PARATRAIN_PS_REPLICAS={self.ps_replicas} needs 1..{self.num_servers} (the parameter servers)"
            )
        expected_role = "server" if self.rank >= self.world_size - self.num_servers else "worker"
        if self.role != expected_role:
            raise ConfigError(
                f"rank {self.rank} of {self.world_size} with {self.num_servers} servers is a {expected_role}, "
                f"but PARATRAIN_ROLE says {self.role}"
            )
        for name in ("timeout", "rdzv_timeout", "heartbeat", "heartbeat_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_timeout <= self.heartbeat:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout}s) must exceed the heartbeat interval "
                f"({self.heartbeat}s), or every peer would be declared lost"
            )
        if self.max_restarts < 0 or self.restart_count < 0:
            raise ConfigError(
                f"max_restarts ({self.max_restarts}) and restart_count ({self.restart_count}) must be >= 0"
            )
        if self.min_workers < 0 or self.min_workers > max(self.world_size, self.launched_workers):
            raise ConfigError(
                f"min_workers ({self.min_workers}) must be between 0 and the job's {self.world_size} workers"
            )
        if self.min_workers and self.num_servers:
            raise ConfigError("an elastic job (min_workers) has no parameter servers: replicate them instead")
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the job secret has {len(self.secret)} bytes, fewer than {MIN_SECRET_BYTES}")
        for port_name in ("master_port", "rdzv_port"):
            port = getattr(self, port_name)
            if not 0 < port < 65536:
                raise ConfigError(f"{port_name} {port} is not a TCP port (1..65535)")

    @property
    def num_workers(self) -> int:
        """Worker processes in the job (the world of collectives and of ``paratrain.world_size()``)."""
        return self.world_size - self.num_servers

    @property
    def server_ranks(self) -> tuple[int, ...]:
        """Transport ranks of the parameter servers (the last :attr:`num_servers` ranks), in server order."""
        return tuple(range(self.num_workers, self.world_size))

    @property
    def role_rank(self) -> int:
        """This process's index among the processes of its role."""
        return self.rank if self.role == "worker" else self.rank - self.num_workers

    @property
    def resilient(self) -> bool:
        """True when the job outlives a worker's death (restarts or elastic): collectives then break on any
        crash, for :mod:`paratrain.recovery` to mend."""
        return self.max_restarts > 0 or self.min_workers > 0

    @property
    def elastic(self) -> bool:
        """True when the job's membership may change (``min_workers`` > 0)."""
        return self.min_workers > 0

    @property
    def member_id(self) -> int:
        """The stable identity of this process in the job (see :attr:`member`)."""
        return self.rank if self.member is None else self.member

    @property
    def job_workers(self) -> int:
        """The workers the job was launched with (see :attr:`launched_workers`)."""
        return self.launched_workers or self.num_workers

    def replace(self, **changes: object) -> Settings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Reads the settings from ``env`` (default ``os.environ``).

        Precedence: explicit ``RANK``/``WORLD_SIZE`` (torchrun, ``paratrain launch``) over SLURM's variables;
        with neither, a single process (rank 0 of 1).

        Example:
            >>> s = Settings.from_env({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
            ...                        "MASTER_PORT": "29500"})
            >>> (s.rank, s.world_size, s.rdzv_port)
            (1, 4, 29501)
        """
        if env is None:
            env = os.environ
        if "RANK" in env or "WORLD_SIZE" in env:
            if "RANK" not in env or "WORLD_SIZE" not in env:
                raise ConfigError("RANK and WORLD_SIZE must be set together (found only one of them)")
            rank = _get_int(env, "RANK", 0)
            world = _get_int(env, "WORLD_SIZE", 1)
            local_rank = _get_opt_int(env, "LOCAL_RANK")
            local_world = _get_opt_int(env, "LOCAL_WORLD_SIZE")
            if local_rank is None:
                local_rank = rank
            if local_world is None:
                local_world = world if env.get("LOCAL_RANK") is None else max(local_rank + 1, 1)
            if "PARATRAIN_RUN_ID" in env and "PARATRAIN_RDZV_PORT" in env and env.get("PARATRAIN_LAUNCHER"):
                launched_by = "paratrain"
            elif "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
                launched_by = "torchrun"
            else:
                launched_by = "env"
            master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            rank = _get_int(env, "SLURM_PROCID", 0)
            world = _get_int(env, "SLURM_NTASKS", 1)
            local_rank = _get_int(env, "SLURM_LOCALID", 0)
            local_world = _slurm_local_world(env, default=max(local_rank + 1, 1))
            launched_by = "slurm"
            if "MASTER_ADDR" in env:
                master_addr = env["MASTER_ADDR"]
            else:
                nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                if not nodelist:
                    raise ConfigError("under SLURM, set MASTER_ADDR or run inside a job with SLURM_JOB_NODELIST")
                master_addr = first_host_of_nodelist(nodelist)
        else:
            rank, world, local_rank, local_world = 0, 1, 0, 1
            launched_by = "none"
            master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        rank, world, role, num_servers = _resolve_roles(env, rank, world)
        master_port = _get_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
        rdzv_port = _get_int(env, "PARATRAIN_RDZV_PORT", master_port + 1)
        heartbeat = _get_float(env, "PARATRAIN_HEARTBEAT", 1.0)
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            local_world_size=local_world,
            master_addr=master_addr,
            master_port=master_port,
            rdzv_addr=env.get("PARATRAIN_RDZV_ADDR", master_addr),
            rdzv_port=rdzv_port,
            rdzv_hosted=env.get("PARATRAIN_RDZV_HOSTED", "0") == "1",
            advertise_addr=env.get("PARATRAIN_ADDR") or None,
            host_id=host_id(env),
            transport=env.get("PARATRAIN_TRANSPORT", "zmq"),
            timeout=_get_float(env, "PARATRAIN_TIMEOUT", 300.0),
            rdzv_timeout=_get_float(env, "PARATRAIN_RDZV_TIMEOUT", 120.0),
            heartbeat=heartbeat,
            heartbeat_timeout=_get_float(env, "PARATRAIN_HEARTBEAT_TIMEOUT", max(30.0, 3 * heartbeat)),
            lane_mb=_get_int(env, "PARATRAIN_SHM_LANE_MB", 64),
            faults=env.get("PARATRAIN_FAULTS") or None,
            role=role,
            num_servers=num_servers,
            ps_replicas=_get_int(env, "PARATRAIN_PS_REPLICAS", 1),
            ps_worker_restarts=_get_flag(env, "PARATRAIN_PS_WORKER_RESTARTS"),
            run_id=env.get("PARATRAIN_RUN_ID")
            or env.get("TORCHELASTIC_RUN_ID")
            or env.get("SLURM_JOB_ID")
            or "default",
            run_dir=env.get("PARATRAIN_RUN_DIR") or None,
            timeline=env.get("PARATRAIN_TIMELINE") or None,
            scratch_dir=env.get("PARATRAIN_SCRATCH_DIR") or None,
            launched_by=launched_by,
            max_restarts=_get_int(env, "PARATRAIN_MAX_RESTARTS", 0),
            restart_count=_get_int(env, "PARATRAIN_RESTART_COUNT", 0),
            min_workers=_get_int(env, "PARATRAIN_MIN_WORKERS", 0),
            secret=parse_secret(env[SECRET_ENV]) if env.get(SECRET_ENV, "").strip() else None,
            insecure=_get_flag(env, "PARATRAIN_INSECURE"),
        )


def _resolve_roles(env: Mapping[str, str], rank: int, world: int) -> tuple[int, int, str, int]:
    """Global (transport) rank and world size, role and server count, from either convention.

    ``paratrain launch --servers S`` keeps ``WORLD_SIZE`` the number of workers (as torch expects) and adds
    ``PARATRAIN_NUM_SERVERS``; a server gets ``PARATRAIN_ROLE=server`` and ``RANK`` = its server index.
    Under torchrun or SLURM, ``PARATRAIN_SERVERS=S`` makes the last S of ``WORLD_SIZE`` ranks servers.
    """
    role = env.get("PARATRAIN_ROLE", "worker")
    launched = _get_opt_int(env, "PARATRAIN_NUM_SERVERS")
    by_rank = _get_opt_int(env, "PARATRAIN_SERVERS")
    if launched is not None and by_rank is not None:
        raise ConfigError("set PARATRAIN_NUM_SERVERS (paratrain launch) or PARATRAIN_SERVERS (torchrun), not both")
    if launched is not None:
        if launched < 0:
            raise ConfigError(f"PARATRAIN_NUM_SERVERS={launched} must be >= 0")
        if role == "server":
            if not 0 <= rank < launched:
                raise ConfigError(f"server RANK {rank} outside 0..{launched - 1} (PARATRAIN_NUM_SERVERS={launched})")
            return world + rank, world + launched, role, launched
        return rank, world + launched, role, launched
    if by_rank is not None:
        if not 0 <= by_rank < world:
            raise ConfigError(f"PARATRAIN_SERVERS={by_rank} must leave at least one of WORLD_SIZE={world} as worker")
        return rank, world, "server" if rank >= world - by_rank else "worker", by_rank
    return rank, world, role, 0


def _slurm_local_world(env: Mapping[str, str], *, default: int) -> int:
    """Tasks on this node: ``SLURM_NTASKS_PER_NODE`` or the first entry of ``SLURM_TASKS_PER_NODE`` (``4(x2)``)."""
    direct = _get_opt_int(env, "SLURM_NTASKS_PER_NODE")
    if direct is not None:
        return direct
    raw = env.get("SLURM_TASKS_PER_NODE")
    if raw:
        match = re.match(r"^\s*(\d+)", raw)
        if match:
            return int(match.group(1))
    return default
