"""Helpers to run several ranks as threads of one process: fast, deterministic multi-rank tests; and a
symbolic executor of reduction plans (:func:`count_contributions`).

:func:`run_ranks` gives each rank a context on a shared :class:`~paratrain.transport.inproc.InprocFabric`
(or real ZeroMQ sockets on loopback), runs the same function in every rank, and returns the results in rank
order. If any rank raises, every other rank's pending and future receives fail at once with
:class:`RankFailedError`, so one failure never turns into a hang; the first error is re-raised.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from paratrain.config import Settings
from paratrain.errors import CommTimeoutError, ConfigError, ParatrainError
from paratrain.plan.ir import Plan, Received, Slice
from paratrain.runtime.context import Context
from paratrain.transport.base import Transport
from paratrain.transport.registry import local_job, zmq_transports

__all__ = ["RankFailedError", "count_contributions", "rank_context", "run_ranks", "zmq_transports"]

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


def count_contributions(plan: Plan, count: int, *, aliased: bool = False) -> list[npt.NDArray[np.int64]]:
    """Executes a reduction plan symbolically: every item a vector of counts per rank (rank r's ``src`` holds
    one of its own), reductions add them, copies copy them; a rank waits at an action whose message has not
    arrived, sends copy what they read, and a receive takes the messages from its peer in the order the
    receives were posted (as the transports match them). Returns every rank's ``dst``: all ones (of shape
    ``(count, n)``) when every rank's contribution reached every item exactly once. For the tests of new
    schedules, before any real rank runs them.

    Raises:
        AssertionError: the plan deadlocks, leaves a message unreceived, or matches a message to a receive
            of another size.
    """
    n = len(plan.ranks)
    bufs: list[dict[str, npt.NDArray[np.int64]]] = []
    for r in range(n):
        src = np.zeros((count, n), dtype=np.int64)
        src[:, r] = 1
        bufs.append({"src": src, "dst": src if aliased else np.full((count, n), -99, dtype=np.int64)})
    wires: dict[tuple[int, int, int], list[npt.NDArray[np.int64]]] = defaultdict(list)  # messages sent, in order
    posted: dict[tuple[int, int, int], int] = defaultdict(int)  # receives posted so far per (src, dst, tag)
    slot: list[dict[int, tuple[tuple[int, int, int], int]]] = [{} for _ in range(n)]  # recv -> its message
    pc = [0] * n

    def message(r: int, d: int) -> npt.NDArray[np.int64] | None:
        wire, k = slot[r][d]
        return wires[wire][k] if k < len(wires[wire]) else None

    def read(r: int, op: Any) -> npt.NDArray[np.int64]:
        if isinstance(op, Received):
            frame = message(r, op.action)
            assert frame is not None
            return frame
        assert isinstance(op, Slice) and op.index == 0
        return bufs[r][op.buffer][op.start : op.stop]

    progress = True
    while progress:
        progress = False
        for r in range(n):
            actions = plan.ranks[r]
            while pc[r] < len(actions):
                a = actions[pc[r]]
                waits = [d for d in a.deps if actions[d].kind == "recv" and message(r, d) is None]
                if waits:
                    break
                if a.kind == "recv":
                    wire = (a.peer, r, a.tag)
                    slot[r][pc[r]] = (wire, posted[wire])
                    posted[wire] += 1
                elif a.kind == "send":
                    wires[(r, a.peer, a.tag)].append(read(r, a.data).copy())
                elif a.kind in ("reduce", "copy"):
                    for op in (a.data, a.other):
                        if isinstance(op, Received):
                            got = read(r, op)
                            assert len(got) == actions[op.action].items, "a message matched a receive of another size"
                    out = read(r, a.out)
                    out[...] = read(r, a.data) + read(r, a.other) if a.kind == "reduce" else read(r, a.data)
                pc[r] += 1
                progress = True
    assert pc == [len(actions) for actions in plan.ranks], "the plan deadlocks"
    assert all(posted[w] == len(m) for w, m in wires.items()), "a message was never received"
    return [b["dst"] for b in bufs]
