"""Helpers to run several ranks as threads of one process: fast, deterministic multi-rank tests.

:func:`run_ranks` gives each rank a context on a shared :class:`~paratrain.transport.inproc.InprocFabric`
(or real ZeroMQ sockets on loopback), runs the same function in every rank, and returns the results in rank
order. If any rank raises, every other rank's pending and future receives fail at once with
:class:`RankFailedError`, so one failure never turns into a hang; the first error is re-raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from paratrain.config import Settings
from paratrain.errors import CommTimeoutError, ConfigError, ParatrainError
from paratrain.runtime.context import Context
from paratrain.transport.base import Transport
from paratrain.transport.registry import local_job, zmq_transports

__all__ = ["RankFailedError", "rank_context", "run_ranks", "zmq_transports"]

R = TypeVar("R")


class RankFailedError(ParatrainError, RuntimeError):
    """Another rank of an in-process job failed; this rank was woken so as not to hang."""


def rank_context(
    transport: Transport, *, workers: int, servers: int = 0, timeout: float = 60.0, faults: str | None = None
) -> Context:
    """The context of ``transport``'s rank in an in-process job of ``workers`` workers and ``servers`` parameter
    servers (the last ranks), as :func:`run_ranks` builds it; for tests that run their ranks themselves.
    ``faults``: the fault spec the transport was wrapped with (so that, as in a real job, collectives do not
    take the shared-memory path around the emulated links)."""
    total, rank = workers + servers, transport.rank
    settings = Settings(
        rank=rank,
        world_size=total,
        local_rank=rank,
        local_world_size=total,
        transport="inproc",
        timeout=timeout,
        num_servers=servers,
        role="worker" if rank < workers else "server",
        faults=faults,
    )
    return Context(settings=settings, transport=transport)


def run_ranks(
    world_size: int,
    fn: Callable[[Context], R],
    *,
    transport: str = "inproc",
    timeout: float = 60.0,
    faults: str | None = None,
    servers: int = 0,
) -> list[R]:
    """Runs ``fn(ctx)`` in ``world_size`` threads, one per rank, and returns the results in rank order.

    With ``servers=S``, S more threads run parameter servers (ranks ``world_size..world_size+S-1`` of the
    transport); ``fn`` runs on the workers only, whose contexts know the servers (``paratrain.ps.KVStore``).

    Args:
        world_size: number of ranks.
        fn: the code of one rank; receives its :class:`~paratrain.Context`.
        transport: ``"inproc"`` (default) or ``"zmq"`` (real sockets on loopback).
        timeout: seconds before the whole job is declared hung (and every rank woken with an error).
        faults: optional fault-injection spec applied to every rank's transport.
        servers: parameter-server threads to run beside the workers.

    Raises:
        The first exception raised by any rank (by rank order among simultaneous failures), or
        CommTimeoutError if the job did not finish in ``timeout``.

    Example:
        >>> run_ranks(3, lambda ctx: ctx.rank * 10)
        [0, 10, 20]
    """
    from paratrain.ps.server import ParameterServer

    workers, total = world_size, world_size + servers
    try:
        job = local_job(transport, total, timeout=timeout, faults=faults)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    transports = job.transports
    results: list[R | None] = [None] * workers
    errors: list[BaseException | None] = [None] * total
    failed = threading.Event()
    lock = threading.Lock()

    def wake_all(origin: int, exc: BaseException) -> None:
        with lock:
            if failed.is_set():
                return
            failed.set()
        wake = RankFailedError(f"rank {origin} failed with {type(exc).__name__}: {exc}")
        wake.__cause__ = exc
        if job.fail_all is not None:
            job.fail_all(wake)
        for r, t in enumerate(transports):
            if r != origin:
                t.abort(wake)

    def body(rank: int) -> None:
        ctx = rank_context(transports[rank], workers=workers, servers=servers, timeout=timeout, faults=faults)
        try:
            if rank < workers:
                results[rank] = fn(ctx)
            else:
                ParameterServer(
                    transports[rank], num_workers=workers, servers=ctx.settings.server_ranks, timeout=timeout
                ).serve()
        except BaseException as exc:
            errors[rank] = exc
            wake_all(rank, exc)
        finally:
            if not failed.is_set():
                ctx.shutdown()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True) for r in range(total)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        wake_all(hung[0], CommTimeoutError(f"ranks {hung} still running after {timeout}s"))
        for t in threads:
            t.join(5.0)
    for tr in transports:
        tr.abort()
    primary = [e for e in errors if e is not None and not isinstance(e, RankFailedError)]
    if primary:
        raise primary[0]
    if hung:
        raise CommTimeoutError(f"in-process job hung: ranks {hung} did not finish within {timeout}s")
    secondary = [e for e in errors if e is not None]
    if secondary:
        raise secondary[0]
    return results  # type: ignore[return-value]
