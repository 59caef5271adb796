"""Servers joining and leaving a running job (:mod:`paratrain.ps.resize`): no update lost or applied twice, the
same model as a job that never resized, and the requests caught in a move served where their chunk went
(in-process ranks and servers; every resize is asked for at a fixed step of one worker, the others go on)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from paratrain import Context
from paratrain.errors import ConfigError
from paratrain.ps import KVStore
from paratrain.ps.membership import ServerSet, moved_chunks
from paratrain.ps.protocol import PSRequestError
from paratrain.testing import run_ranks

pytestmark = pytest.mark.timeout(90)

SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.5}


@pytest.mark.parametrize(("consistency", "staleness"), [("bsp", None), ("ssp", 2), ("asp", None)])
def test_audit_no_update_lost_or_applied_twice_across_an_add_and_a_remove(
    consistency: str, staleness: int | None
) -> None:
    """Three workers add their rank + 1 to a dense integer key and 1 to two rows of an embedding every clock; worker
    0 adds server 2 at clock 3, worker 1 removes server 0 at clock 7 (its chunks go to 1 and 2). Every push counts
    exactly once. ASP has no clock bound: each worker waits for its pushes and the workers meet before reading."""
    workers, clocks = 3, 12

    def worker(ctx: Context) -> tuple[int, int, tuple[int, ...], list[dict[str, Any]]]:
        kv = KVStore(consistency, staleness, context=ctx, active_servers=2, chunk_bytes=64)
        kv.init("w", np.zeros(200, dtype=np.int64))  # 25 chunks of 8
        kv.init("e", np.zeros((30, 4), dtype=np.int64))  # 15 chunks of 2 rows
        resized = []
        for c in range(clocks):
            pushes = [
                kv.push("w", np.full(200, ctx.rank + 1, dtype=np.int64)),
                kv.push_rows("e", [c % 30, 3], np.ones((2, 4), dtype=np.int64)),
            ]
            if consistency == "asp":
                for p in pushes:
                    p.wait(30)
            if (ctx.rank, c) == (0, 3):
                resized.append(kv.add_server(2).wait())
            if (ctx.rank, c) == (1, 7):
                resized.append(kv.remove_server(0).wait())
            kv.clock()
            kv.pull("w")
        if consistency == "asp":
            ctx.barrier()
        for _ in range(0 if consistency == "asp" else 1 + (staleness or 0)):
            kv.clock()
        out = (int(kv.pull("w").sum()), int(kv.pull("e").sum()), kv.active_servers, resized)
        kv.close()
        return out

    results = run_ranks(workers, worker, servers=3)
    assert [r[:3] for r in results] == [(clocks * 6 * 200, clocks * workers * 8, (1, 2))] * workers
    added, removed = results[0][3][0], results[1][3][0]
    assert added["active"] == [0, 1, 2] and removed["active"] == [1, 2]
    expect_added = sum(
        len(moved_chunks(k, n, ServerSet.first(3, 2), ServerSet.first(3))) for k, n in (("w", 25), ("e", 15))
    )
    assert added["chunks"] == expect_added > 0 and added["rounds"] >= 1


def _sgd(resize: bool, workers: int = 3, steps: int = 8) -> list[np.ndarray]:
    def worker(ctx: Context) -> np.ndarray:
        kv = KVStore(optimizer=SGD, context=ctx, chunk_bytes=64, active_servers=2 if resize else None)
        kv.init("w", np.arange(40, dtype=np.float64) / 8)
        for step in range(steps):
            w = kv.pull("w")
            kv.push("w", np.floor(np.sin(w * (ctx.rank + 1) + step) * 8) / 8)  # dyadic: exact sums in any order
            if resize and (ctx.rank, step) == (2, 2):
                kv.add_server(2)  # the chunks move at the workers' next calls
            if resize and (ctx.rank, step) == (0, 5):
                kv.remove_server(1)
            kv.clock()
        out = kv.pull("w")
        kv.close()
        return out

    return run_ranks(workers, worker, servers=3 if resize else 2)


def test_a_resized_bsp_job_with_a_server_side_optimizer_ends_with_the_static_jobs_model() -> None:
    """Server-side SGD with momentum: the optimizer state and the open rounds move with the chunks, so a job that
    adds a server and removes another reaches the model of a job on two servers that never changed, bitwise."""
    static, resized = _sgd(False), _sgd(True)
    for a, b in zip(static, resized, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_init_caught_in_a_move_is_served_where_its_chunk_went() -> None:
    """Worker 1 inits a key first (it waits at each chunk's server for rank 0's value) when worker 0 adds a server:
    the waiting inits of the chunks that move are answered "moved" and sent to their new server, where rank 0's
    value arrives. Worker 0 asks for the resize once worker 1's inits have left (an event of the in-process ranks,
    which are threads), so they are caught every run. The resize before (worker 1 waits in its clock then, for no
    chunk) sends nothing again."""
    inits_sent = threading.Event()

    def worker(ctx: Context) -> tuple[int, int, int]:
        kv = KVStore(context=ctx, chunk_bytes=64, active_servers=2)
        kv.init("w", np.zeros(64, dtype=np.int64))  # 8 chunks
        kv.push("w", np.ones(64, dtype=np.int64))
        if ctx.rank == 0:
            kv.add_server(2).wait()
        kv.clock()
        first = int(kv.pull("w").sum())
        if ctx.rank == 1:
            isend = ctx.transport.isend

            def noted(dst: int, tag: int, arrays: Any = (), meta: Any = None) -> Any:
                handle = isend(dst, tag, arrays, meta)
                if isinstance(meta, dict) and meta.get("op") == "init" and meta.get("key") == "late":
                    inits_sent.set()
                return handle

            ctx.transport.isend = noted  # type: ignore[method-assign]
        if ctx.rank == 0:
            assert inits_sent.wait(30)  # worker 1 waits in its init for this worker's value
            kv.add_server(3).wait()
        kv.init("late", np.full(64, 5 if ctx.rank == 0 else 9, dtype=np.int64))
        kv.clock()
        late = int(kv.pull("late").sum())
        moved = kv.moved_requests
        kv.close()
        return first, late, moved

    results = run_ranks(2, worker, servers=4)
    assert [r[:2] for r in results] == [(128, 320)] * 2
    caught = len(moved_chunks("late", 8, ServerSet(4, (0, 1, 2), 1), ServerSet.first(4)))
    assert results[0][2] == 0 and results[1][2] == caught > 0  # each of worker 1's inits of a chunk that moved


def test_what_cannot_resize_is_refused_with_the_reason() -> None:
    def worker(ctx: Context) -> list[str]:
        with pytest.raises(ConfigError, match="active_servers"):
            KVStore(context=ctx).add_server(2)  # (refused before anything is sent)
        with pytest.raises(ConfigError, match="replicas=1"):
            KVStore(context=ctx, active_servers=2, replicas=2)
        errors = []
        kv = KVStore(context=ctx, active_servers=2)
        kv.init("w", np.zeros(4))
        for change, server in (("add", 1), ("add", 5), ("remove", 2)):
            with pytest.raises(PSRequestError) as info:
                (kv.add_server if change == "add" else kv.remove_server)(server).wait()
            errors.append(str(info.value))
        kv.close()
        return errors

    errors = run_ranks(1, worker, servers=3)[0]
    assert "holds keys already" in errors[0] and "outside 0..2" in errors[1] and "holds no keys" in errors[2]
