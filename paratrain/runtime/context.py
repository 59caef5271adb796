"""The per-rank context (rank, world size, transport) and the ``init``/``shutdown`` life cycle.

A :class:`Context` is an ordinary object: several can live in one process (one per thread, for in-process
tests), and code that avoids globals passes one around. ``paratrain.init()`` also makes the new context the
*current* one for the module-level functions (``paratrain.rank()``, ``paratrain.barrier()``...): current for
the calling thread, and for the whole process if it is the first. ``shutdown()`` runs at interpreter exit too.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NoReturn, TypeVar

from paratrain._current import set_lookup
from paratrain.collectives.api import Collectives
from paratrain.collectives.exchange import Exchange
from paratrain.collectives.tree import agree
from paratrain.config import Settings
from paratrain.errors import ConfigError, NotInitializedError
from paratrain.runtime.group import COLLECTIVE_TAG_BASE, CollectiveMethods, Group, closed_check
from paratrain.runtime.spare import SPARE_ENV, await_assignment
from paratrain.transport.base import Transport
from paratrain.transport.registry import connect

__all__ = ["COLLECTIVE_TAG_BASE", "Context", "Group", "current", "init", "reform", "shutdown"]

log = logging.getLogger("paratrain")

A = TypeVar("A")


class Context(CollectiveMethods):
    """One rank's membership in a job.

    Attributes:
        settings: the resolved configuration.
        transport: the transport all communication of this rank goes through.

    Example:
        >>> import paratrain as pt
        >>> ctx = pt.init(transport="inproc")       # a world of one, no network
        >>> (ctx.rank, ctx.world_size)
        (0, 1)
        >>> ctx.barrier()
        >>> ctx.shutdown()
    """

    def __init__(self, *, settings: Settings, transport: Transport, on_close: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.transport = transport
        if settings.num_servers and transport.world_size == settings.world_size and settings.role == "worker":
            from paratrain.transport.group import GroupTransport

            self.workers: Transport = GroupTransport(transport, list(range(settings.num_workers)))
        else:
            self.workers = transport
        self._on_close = on_close
        self._closed = False
        self._group_lock = threading.Lock()
        self._spaces = itertools.count(1)  # tag spaces of sub-groups; the world's is 0
        self._groups: list[Group] = []
        #: Every worker, as a group: what the collective methods below run on.
        self.world = Group(
            transport=self.workers,
            ranks=range(self.workers.world_size),
            tag_space=0,
            settings=settings,
            hosts=_workers_hosts(transport, self.workers.world_size),
            check_open=closed_check(lambda: self._closed),
        )

    @property
    def rank(self) -> int:
        """This process's rank among the workers (a server's index among the servers)."""
        return self.workers.rank if self.settings.role == "worker" else self.settings.role_rank

    @property
    def world_size(self) -> int:
        """Number of workers in the job (parameter servers are not counted; see ``settings.num_servers``)."""
        return self.workers.world_size

    @property
    def local_rank(self) -> int:
        """Rank among the processes on this host."""
        return self.settings.local_rank

    @property
    def local_world_size(self) -> int:
        """Number of processes on this host."""
        return self.settings.local_world_size

    @property
    def closed(self) -> bool:
        """True after :meth:`shutdown`."""
        return self._closed

    def next_collective_tag(self) -> int:
        """A fresh tag of the world group for the next collective call (all ranks call them in the same order)."""
        return self.world.next_tag()

    def _check_open(self) -> None:
        if self._closed:
            raise NotInitializedError("this paratrain context was shut down; call paratrain.init() again")

    def barrier(self, timeout: float | None = None) -> None:
        """Blocks until every rank has called ``barrier``. Thread-safe, but call it from one thread per rank.

        Raises:
            PeerLostError: a rank died before arriving.
            CommTimeoutError: some rank did not arrive within ``timeout`` (default ``PARATRAIN_TIMEOUT``).
        """
        self._check_open()
        self.world.barrier(timeout)

    # -- groups

    def new_group(self, ranks: Sequence[int], *, timeout: float | None = None) -> Group | None:
        """A group of the workers ``ranks``, with its own collectives and tag space; None on non-members.

        Collective over the world: every worker calls it, in the same order relative to other ``new_group``
        and ``split`` calls, with the same ``ranks``. Blocks for one agreement round (ceil(log2 N) messages).

        Raises:
            ValueError: ``ranks`` is empty, repeats a rank or names one outside the workers.
            ConfigError: the workers passed different ranks (on every rank, naming them).

        Example:
            >>> import numpy as np
            >>> from paratrain.testing import run_ranks
            >>> def fn(ctx):
            ...     evens = ctx.new_group([0, 2])
            ...     return None if evens is None else evens.allreduce(np.array([ctx.rank])).tolist()
            >>> run_ranks(3, fn)
            [[2], None, [2]]
        """
        members = sorted(int(r) for r in ranks)
        n = self.world_size
        if not members or len(set(members)) != len(members) or not all(0 <= r < n for r in members):
            raise ValueError(f"new_group({list(ranks)}): give distinct worker ranks in 0..{n - 1}")
        keys: list[Hashable] = [r in members for r in range(n)]
        return self._form("new_group", keys, timeout=timeout, member=self.rank in members)

    def split(self, key: Callable[[int], Hashable] | Sequence[Hashable], *, timeout: float | None = None) -> Group:
        """Partitions the workers into groups of equal ``key`` and returns this rank's group.

        ``key`` is a function of the worker rank (``lambda r: r // 4`` makes consecutive stages of 4) or one key
        per worker. Groups from one call are disjoint and share one tag space; each has its own collectives.
        Collective over the world, like :meth:`new_group` (the workers must agree on every rank's key).

        Raises:
            ValueError: a sequence of keys whose length is not the number of workers.
            ConfigError: the workers computed different keys (on every rank).
        """
        n = self.world_size
        keys = [key(r) for r in range(n)] if callable(key) else list(key)
        if len(keys) != n:
            raise ValueError(f"split: {len(keys)} keys for {n} workers; give one per worker")
        group = self._form("split", keys, timeout=timeout, member=True)
        assert group is not None  # every worker is a member of its own key's group
        return group

    def split_by_host(self, *, timeout: float | None = None) -> Group:
        """One group per host (the ranks that share memory), e.g. for intra-host data parallelism."""
        hosts = _workers_hosts(self.transport, self.world_size)
        return self.split(hosts if hosts is not None else [""] * self.world_size, timeout=timeout)

    def _form(self, what: str, keys: list[Hashable], *, timeout: float | None, member: bool) -> Group | None:
        self._check_open()
        with self._group_lock:
            space = next(self._spaces)
        wanted = [what, space, [repr(k) for k in keys]]
        if self.world_size > 1:
            limit = timeout or self.settings.timeout
            with Exchange(self.workers, tag=self.next_collective_tag(), timeout=limit, label=what) as ex:
                everyone = agree(ex, wanted)
            differ = [q for q, sig in enumerate(everyone) if sig != everyone[0]]
            if differ:
                raise ConfigError(
                    f"{what} #{space}: the workers disagree: rank 0 asked for {everyone[0][2]}, rank {differ[0]} "
                    f"for {everyone[differ[0]][2]}; every worker must form the same groups in the same order"
                )
        if not member:
            return None
        mine = keys[self.rank]
        members = [r for r in range(self.world_size) if keys[r] == mine]
        from paratrain.transport.group import GroupTransport

        hosts = self.world._hosts
        group = Group(
            transport=GroupTransport(self.workers, members),
            ranks=members,
            tag_space=space,
            settings=self.settings,
            hosts=None if hosts is None else [hosts[r] for r in members],
            check_open=closed_check(lambda: self._closed),
        )
        with self._group_lock:
            self._groups.append(group)
        return group

    def workers_share_memory(self) -> bool:
        """True when every worker runs on this host and nothing emulates a network between them.

        Then shared memory may carry their data instead of sockets (the collectives and gossip use it); with a
        fault injector it must not, or the emulated links would be bypassed.
        """
        from paratrain.transport.faults import FaultyTransport

        hosts = _workers_hosts(self.transport, self.workers.world_size)
        if hosts is None or len(set(hosts)) != 1 or self.settings.faults is not None:
            return False
        seen: Transport | None = self.transport
        while seen is not None:
            if isinstance(seen, FaultyTransport):
                return False
            seen = getattr(seen, "inner", None)
        return True

    @property
    def collectives(self) -> Collectives:
        """This rank's :class:`~paratrain.collectives.api.Collectives` (where algorithms are registered)."""
        self._check_open()
        return self.world.collectives

    def shutdown(self) -> None:
        """Leaves the job: says goodbye to the peers and releases sockets and threads. Idempotent.

        Pending ``*_async`` collectives fail (wait for their handles first to let them finish).
        """
        self._leave(self.transport.close)

    def abort(self) -> None:
        """Leaves a broken job at once: drops every connection without goodbye, as a crash would. Idempotent.

        What :func:`reform` does before meeting the others again; pending operations fail.
        """
        self._leave(self.transport.abort)

    def _leave(self, release: Callable[[], None]) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            release()
        finally:
            for group in [*self._groups, self.world]:
                group.close()
            if self._on_close is not None:
                self._on_close()
            _forget(self)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _workers_hosts(transport: Transport, num_workers: int) -> list[str] | None:
    ids = _host_ids(transport)
    return None if ids is None else ids[:num_workers]


def _host_ids(transport: Transport) -> list[str] | None:
    """Every rank's host id, if the transport (or the one it wraps) knows them."""
    seen: Transport | None = transport
    while seen is not None:
        host_ids = getattr(seen, "host_ids", None)
        if callable(host_ids):
            ids: list[str] = host_ids()
            return ids
        seen = getattr(seen, "inner", None)
    return None


_local = threading.local()
_process_default: Context | None = None
_registry_lock = threading.Lock()
_atexit_registered = False


def current() -> Context:
    """The calling thread's context, else the process's; raises NotInitializedError if there is none."""
    ctx: Context | None = getattr(_local, "ctx", None) or _process_default
    if ctx is None or ctx.closed:
        raise NotInitializedError("paratrain is not initialised in this process; call paratrain.init() first")
    return ctx


set_lookup(current)


def _set_current(ctx: Context) -> None:
    global _process_default, _atexit_registered
    _local.ctx = ctx
    with _registry_lock:
        if _process_default is None or _process_default.closed:
            _process_default = ctx
        if not _atexit_registered:
            atexit.register(_shutdown_all_at_exit)
            _atexit_registered = True


def _forget(ctx: Context) -> None:
    global _process_default
    if getattr(_local, "ctx", None) is ctx:
        _local.ctx = None
    with _registry_lock:
        if _process_default is ctx:
            _process_default = None


def _shutdown_all_at_exit() -> None:
    ctx = _process_default
    if ctx is not None and not ctx.closed:
        try:
            ctx.shutdown()
        except Exception:  # at exit, report and go on: there is nobody left to raise to
            log.exception("paratrain: shutdown at exit failed")


def init(
    *,
    transport: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    faults: str | None = None,
    fabric: object | None = None,
    make_current: bool = True,
) -> Context:
    """Joins the job described by the environment (or the arguments) and returns this rank's context.

    With no launcher variables set, the job is a single process (rank 0 of 1). Under ``paratrain launch``,
    ``torchrun`` or SLURM the ranks find each other through the rendezvous (see :mod:`.rendezvous`).

    Args:
        transport: ``"zmq"`` (default; real sockets) or ``"inproc"`` (threads of one process; pass ``fabric``).
        rank: overrides ``RANK``.
        world_size: overrides ``WORLD_SIZE``.
        env: the environment to read instead of ``os.environ`` (for tests).
        timeout: default timeout of blocking calls in seconds (overrides ``PARATRAIN_TIMEOUT``).
        faults: fault-injection spec (overrides ``PARATRAIN_FAULTS``), e.g. ``"latency=2ms,bandwidth=1Gbit"``.
        fabric: the :class:`~paratrain.transport.inproc.InprocFabric` of an in-process job.
        make_current: make this the current context of the calling thread (and of the process if first).

    Raises:
        ConfigError: inconsistent settings.
        RendezvousError: the ranks could not find each other.

    Example:
        >>> import paratrain as pt
        >>> from paratrain.transport.inproc import InprocFabric
        >>> ctx = pt.init(transport="inproc", fabric=InprocFabric(1), rank=0, world_size=1)
        >>> ctx.world_size
        1
        >>> ctx.shutdown()
    """
    if env is None and os.environ.get(SPARE_ENV) == "1":
        await_assignment()  # a warm spare (paratrain launch --max-restarts): wait to be told which rank to be
    settings = Settings.from_env(env if env is not None else os.environ)
    overrides: dict[str, object] = {}
    if transport is not None:
        overrides["transport"] = transport
    if rank is not None:
        overrides["rank"] = rank
    if world_size is not None:
        overrides["world_size"] = world_size
        if world_size != settings.world_size and settings.launched_by == "none":
            overrides["local_world_size"] = world_size
            overrides["local_rank"] = rank if rank is not None else 0
    if timeout is not None:
        overrides["timeout"] = timeout
    if faults is not None:
        overrides["faults"] = faults or None
    if overrides:
        settings = settings.replace(**overrides)

    result = connect(settings, fabric=fabric)
    settings = _placed(settings, result)
    ctx = Context(settings=settings, transport=result)
    if settings.role == "server":
        _serve_and_exit(ctx)
    if make_current:
        _set_current(ctx)
    log.debug("rank %d of %d initialised (%s)", ctx.rank, ctx.world_size, result.name)
    return ctx


def reform(ctx: Context) -> Context:
    """Leaves a job that lost a rank and meets the others again, in a fresh context.

    For resilient jobs (``paratrain launch --max-restarts`` or ``--min-workers``): the survivors abort their
    connections and register at the launcher's rendezvous once more; the round completes when every member has
    registered (a restarted rank too; in an elastic job, without a member the launcher dropped and with any
    joiner waiting), and everyone connects afresh (new sockets, new collective tags, new shared-memory
    segments). In an elastic job the new context may have another size and this process another rank. Nothing
    else of ``ctx`` carries over: :mod:`paratrain.recovery` carries the training state across. The new context
    is the current one.

    Raises:
        RendezvousError: the others did not all arrive within ``PARATRAIN_RDZV_TIMEOUT`` (no restart came).
    """
    ctx.abort()
    settings = ctx.settings
    transport = connect(settings)
    new = Context(settings=_placed(settings, transport), transport=transport)
    _set_current(new)
    log.info("rank %d of %d: re-formed the job after a failure", new.rank, new.world_size)
    return new


def _placed(settings: Settings, transport: Transport) -> Settings:
    """``settings`` with the rank and size an elastic rendezvous gave ``transport`` (unchanged otherwise)."""
    if not settings.elastic or (transport.rank, transport.world_size) == (settings.rank, settings.world_size):
        return settings
    return settings.replace(
        rank=transport.rank,
        world_size=transport.world_size,
        member=settings.member_id,
        launched_workers=settings.job_workers,
    )


def _serve_and_exit(ctx: Context) -> NoReturn:
    """A server-role process runs the parameter-server loop until the workers are done, then exits 0.

    This is what lets one script serve every role under torchrun (``PARATRAIN_SERVERS=S``), as in BytePS and
    MXNet: ``init()`` never returns in a server.
    """
    from paratrain.ps.server import ParameterServer

    settings = ctx.settings
    log.info("rank %d: parameter server %d of %d", settings.rank, settings.role_rank, settings.num_servers)
    try:
        ParameterServer(
            ctx.transport,
            num_workers=settings.num_workers,
            servers=settings.server_ranks,
            timeout=settings.timeout,
            rejoin=ctx.transport.rejoined,
            worker_restarts=settings.ps_worker_restarts,
        ).serve()
    finally:
        ctx.shutdown()
    raise SystemExit(0)


def shutdown() -> None:
    """Shuts down the current context, if any. Idempotent; also runs at interpreter exit."""
    ctx: Context | None = getattr(_local, "ctx", None) or _process_default
    if ctx is not None:
        ctx.shutdown()
