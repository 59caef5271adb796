"""A parameter-server worker dies and a replacement takes its place (:mod:`paratrain.ps.rejoin`), in-process: the
servers hold its place, the replacement resumes at the interrupted clock, what the dead worker sent counts once,
and the final model equals the fault-free run's bit for bit, wherever in its clock the worker died (a worker is
killed by aborting its transport, as a crash would; its replacement gets a new endpoint of its rank)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from paratrain import Context
from paratrain.errors import WorkDoneError
from paratrain.ps import KVStore
from paratrain.ps.protocol import REQUEST_TAG
from paratrain.ps.server import ParameterServer, ServerStats
from paratrain.testing import rank_context
from paratrain.transport.base import Transport
from paratrain.transport.inproc import InprocFabric

pytestmark = pytest.mark.timeout(90)

SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.5}
STEPS, KILL_AT, WORKERS, SERVERS, TIMEOUT = 6, 3, 3, 2, 30.0


def _grad(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    """A gradient that depends on the parameters and the rank (sums of three in float64 depend on their order)."""
    return np.sin(w * (rank + 1.3) + step) / 3


Run = tuple[np.ndarray, dict[int, np.ndarray]]  # a worker's final model, and the parameters each step computed on


def _steps(kv: KVStore, rank: int, first: int) -> Run:
    read = {}
    for step in range(first, STEPS):
        w = read[step] = kv.pull("w")
        kv.push("w", _grad(w, rank, step)).wait(TIMEOUT)
        kv.clock()
    out = kv.pull("w")
    kv.close()
    return out, read


def _store(ctx: Context, *, rejoin: bool = False) -> KVStore:
    kv = KVStore(optimizer=SGD, context=ctx, chunk_bytes=64, rejoin=rejoin)  # 8 rows a chunk, on both servers
    kv.init("w", np.arange(40, dtype=np.float64) / 8)
    return kv


def _die(ctx: Context, kv: KVStore, how: str) -> None:
    """Worker ``ctx.rank`` at clock ``KILL_AT``: dies before pushing, after pushing, or after its clock reached the
    first server only (that server may take the round's step before the replacement computes it again)."""
    if how != "before push":
        w = kv.pull("w")
        kv.push("w", _grad(w, ctx.rank, KILL_AT)).wait(TIMEOUT)
    if how == "clock on one server":
        first = ctx.settings.server_ranks[0]
        ctx.transport.isend(first, REQUEST_TAG, (), {"op": "clock", "clock": KILL_AT + 1, "id": -1}).wait(TIMEOUT)
        # dies once every worker's clock is counted there: that server has taken the round's step
        router = kv._router  # (a worker's own request, as KVStore.clock sends it)
        router.wait(*router.request(first, {"op": "wait_clock", "required": KILL_AT + 1}), "wait_clock")
    ctx.transport.abort()


def _run_all(fabric: InprocFabric, bodies: list[Callable[[], None]]) -> None:
    """Runs every rank's body in a thread of its own; the first error fails the whole fabric and is raised."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
                fabric.fail_all(exc)

        return run

    threads = [threading.Thread(target=guarded(body), daemon=True) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not [t for t in threads if t.is_alive()], "a rank hung"
    if errors:
        raise errors[0]


def _job(victim: int | None, how: str) -> tuple[list[Run], list[ServerStats], list[int]]:
    """Each worker's run (the victim's from its replacement), the servers' stats, and the clock the replacement
    resumed at (empty without a victim)."""
    fabric = InprocFabric(WORKERS + SERVERS, timeout=TIMEOUT)
    transports: list[Transport] = [fabric.transport(r) for r in range(WORKERS + SERVERS)]
    results: list[Any] = [None] * WORKERS
    stats: list[Any] = [None] * SERVERS
    resumed: list[int] = []

    def serve(rank: int) -> None:
        ctx = rank_context(transports[rank], workers=WORKERS, servers=SERVERS, timeout=TIMEOUT)
        try:
            server = ParameterServer(transports[rank], num_workers=WORKERS, timeout=TIMEOUT, worker_restarts=True)
            stats[rank - WORKERS] = server.serve()
        finally:
            ctx.shutdown()

    def work(rank: int) -> None:
        ctx = rank_context(transports[rank], workers=WORKERS, servers=SERVERS, timeout=TIMEOUT)
        kv = _store(ctx)
        if rank != victim:
            results[rank] = _steps(kv, rank, 0)
            ctx.shutdown()
            return
        for step in range(KILL_AT):
            w = kv.pull("w")
            kv.push("w", _grad(w, rank, step)).wait(TIMEOUT)
            kv.clock()
        _die(ctx, kv, how)
        new = rank_context(fabric.rejoin(rank), workers=WORKERS, servers=SERVERS, timeout=TIMEOUT)
        try:
            again = _store(new, rejoin=True)
            resumed.append(again.resumed_clock)
            results[rank] = _steps(again, rank, again.resumed_clock)
        finally:
            new.shutdown()

    servers = [functools.partial(serve, r) for r in range(WORKERS, WORKERS + SERVERS)]
    _run_all(fabric, servers + [functools.partial(work, r) for r in range(WORKERS)])
    return results, stats, resumed


@pytest.fixture(scope="module")
def fault_free() -> Run:
    results, _, _ = _job(None, "")
    for out, _ in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
    return results[0]


@pytest.mark.parametrize("victim", [0, 2])
@pytest.mark.parametrize("how", ["before push", "after push", "clock on one server"])
def test_a_replacement_resumes_the_interrupted_clock_and_the_model_is_bitwise_the_fault_free_one(
    fault_free: Run, victim: int, how: str
) -> None:
    results, stats, resumed = _job(victim, how)
    assert resumed == [KILL_AT]  # under BSP: the smallest clock a server counted, computed again
    # on the parameters of that clock, though the first server has taken its step ("clock on one server")
    np.testing.assert_array_equal(results[victim][1][KILL_AT], fault_free[1][KILL_AT])
    for out, _ in results:
        np.testing.assert_array_equal(out, fault_free[0])
    duplicates = sum(s.duplicates for s in stats)
    assert duplicates == (0 if how == "before push" else 5)  # the dead worker's push of 5 chunks counted once


def test_the_same_job_without_a_death_sums_in_worker_order_whatever_the_arrival_order(fault_free: Run) -> None:
    """Three pushes summed as they arrive differ in their last bits from run to run; a job that restarts workers
    sums each round in worker order, so every run (and every recovered one) gives the same model."""
    for _ in range(3):
        results, _, _ = _job(None, "")
        np.testing.assert_array_equal(results[0][0], fault_free[0])


def test_a_replacement_of_a_worker_that_had_finished_is_told_its_work_is_done() -> None:
    """Killed after it left the servers (its work done), a worker's replacement has nothing to take over."""
    fabric = InprocFabric(3, timeout=TIMEOUT)
    transports: list[Transport] = [fabric.transport(r) for r in range(3)]
    checked = threading.Event()
    told: list[BaseException] = []

    def serve() -> None:
        ctx = rank_context(transports[2], workers=2, servers=1, timeout=TIMEOUT)
        try:
            ParameterServer(transports[2], num_workers=2, timeout=TIMEOUT, worker_restarts=True).serve()
        finally:
            ctx.shutdown()

    def work(rank: int) -> None:
        ctx = rank_context(transports[rank], workers=2, servers=1, timeout=TIMEOUT)
        kv = _store(ctx)
        if rank == 0:
            checked.wait(TIMEOUT)  # the server serves until this worker leaves too
            kv.close()
            ctx.shutdown()
            return
        kv.close()
        ctx.transport.abort()  # killed after its work was done
        new = rank_context(fabric.rejoin(rank), workers=2, servers=1, timeout=TIMEOUT)
        try:
            _store(new, rejoin=True)
        except WorkDoneError as exc:
            told.append(exc)
        finally:
            checked.set()
            new.shutdown()

    _run_all(fabric, [serve, functools.partial(work, 0), functools.partial(work, 1)])
    assert len(told) == 1 and "had finished its work" in str(told[0])
