"""Parameter server: no lost update, the BSP/SSP/ASP guarantees, stragglers, dead workers, bad input."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from paratrain import Context
from paratrain.errors import ConfigError
from paratrain.ps import KVStore, PSRequestError
from paratrain.ps.protocol import REQUEST_TAG, reply_tag
from paratrain.testing import run_ranks

pytestmark = pytest.mark.timeout(90)

MODELS = [("bsp", None), ("ssp", 2), ("asp", None)]


@pytest.mark.parametrize(("consistency", "staleness"), MODELS)
@pytest.mark.parametrize("servers", [1, 2, 3])
def test_no_lost_update_dense_and_sparse(consistency: str, staleness: int | None, servers: int) -> None:
    workers, clocks = 3, 6
    rows = 37

    def worker(ctx: Context) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        kv = KVStore(consistency, staleness, context=ctx, chunk_bytes=64)  # tiny chunks: keys span all servers
        kv.init("dense", np.zeros(101, dtype=np.int64))
        kv.init("table", np.zeros((rows, 3), dtype=np.int64))
        kv.init(7, np.array(0, dtype=np.int64))  # a 0-d key
        handles = []
        for c in range(clocks):
            handles.append(kv.push("dense", np.arange(101, dtype=np.int64) * (ctx.rank + 1)))
            ids = np.array([c % rows, (5 * ctx.rank + c) % rows, c % rows])  # duplicates on purpose
            handles.append(kv.push_rows("table", ids, np.full((3, 3), ctx.rank + 1, dtype=np.int64)))
            handles.append(kv.push(7, np.array(1, dtype=np.int64)))
            kv.clock()
        for h in handles:
            h.wait(30)  # acknowledged = applied on the server
        ctx.barrier()  # every worker's pushes are applied before anyone reads the final value
        kv.clock()  # under BSP/SSP the final pull then needs everyone's last clock too
        out = (kv.pull("dense"), kv.pull("table"), kv.pull(7))
        kv.close()
        return out

    results = run_ranks(workers, worker, servers=servers)
    dense = np.arange(101, dtype=np.int64) * sum(r + 1 for r in range(workers)) * clocks
    table = np.zeros((rows, 3), dtype=np.int64)
    for r in range(workers):
        for c in range(clocks):
            for i in (c % rows, (5 * r + c) % rows, c % rows):
                table[i] += r + 1
    for d, t, s in results:
        np.testing.assert_array_equal(d, dense)
        np.testing.assert_array_equal(t, table)
        assert int(s) == workers * clocks


def _straggler_run(
    consistency: str, staleness: int | None, clocks: int = 8
) -> tuple[list[int], list[float], list[int]]:
    """3 workers, worker 2 three times slower.

    Returns the max clock lead each worker had over the slowest, finish times, and the straggler's clock when
    each worker finished.
    """
    workers, step = 3, 0.01
    progress = [0] * workers
    lock = threading.Lock()
    leads = [0] * workers
    finish = [0.0] * workers
    straggler_at_finish = [0] * workers
    start = time.monotonic()

    def worker(ctx: Context) -> None:
        kv = KVStore(consistency, staleness, context=ctx)
        kv.init("x", np.zeros(4, dtype=np.int64))
        s = kv.policy.staleness if consistency != "asp" else None
        for c in range(clocks):
            value = int(kv.pull("x")[0])
            # the guarantee: every push at clocks < c - s is in; nothing beyond what could exist is
            if s is not None:
                assert value >= workers * max(0, c - s), (ctx.rank, c, value)
                assert value <= workers * (c + s + 1), (ctx.rank, c, value)
            time.sleep(step * (3 if ctx.rank == 2 else 1))  # the work of one iteration (not event ordering)
            kv.push("x", np.ones(4, dtype=np.int64))
            kv.clock()
            with lock:
                progress[ctx.rank] = c + 1
                leads[ctx.rank] = max(leads[ctx.rank], progress[ctx.rank] - min(progress))
        finish[ctx.rank] = time.monotonic() - start
        with lock:
            straggler_at_finish[ctx.rank] = progress[2]
        kv.close()

    run_ranks(workers, worker, servers=2)
    return leads, finish, straggler_at_finish


def test_bsp_never_runs_ahead() -> None:
    leads, finish, straggler_at_finish = _straggler_run("bsp", None)
    assert max(leads) <= 1  # a worker's clock() returns at c+1 only when everybody reached c+1... or is at c
    assert min(straggler_at_finish) >= 7  # nobody finishes before the straggler's last clock
    print(f"bsp max leads {leads}, finish times {[round(f, 3) for f in finish]}")


@pytest.mark.parametrize("staleness", [2, 3])
def test_ssp_runs_ahead_of_the_straggler_but_within_the_bound(staleness: int) -> None:
    leads, finish, straggler_at_finish = _straggler_run("ssp", staleness)
    # within the bound (a worker that just clocked may lead by s + 1 before the slowest clocks) ...
    assert max(leads) <= staleness + 1
    # ... and not BSP in disguise: the fast workers did get ahead of the straggler (BSP never shows a lead
    # above 1, the moment between a worker's clock() returning and the straggler's own clock() returning)
    assert max(leads[0], leads[1]) >= 2
    # the fast workers finished while the straggler still had up to s clocks to go: they finished sooner
    assert min(straggler_at_finish[0], straggler_at_finish[1]) <= 8 - 2
    print(f"ssp:{staleness} max leads {leads}, finish times {[round(f, 3) for f in finish]}")


def test_asp_never_waits_and_loses_nothing() -> None:
    leads, _, _ = _straggler_run("asp", None)
    assert max(leads[0], leads[1]) >= 3  # fast workers run freely


def test_dead_worker_does_not_block_the_others() -> None:
    clocks = 6

    def worker(ctx: Context) -> int:
        kv = KVStore("bsp", context=ctx)
        kv.init("x", np.zeros(2))
        for c in range(clocks):
            if ctx.rank == 1 and c == 2:
                ctx.transport.abort()  # crashes mid-run, without a goodbye
                return -1
            kv.push("x", np.ones(2))
            kv.clock()
            kv.pull("x")
        kv.close()
        return kv.clock_value

    results = run_ranks(3, worker, servers=2, timeout=60)
    assert results == [clocks, -1, clocks]


def test_bad_input_is_refused_and_the_server_goes_on() -> None:
    def worker(ctx: Context) -> str:
        kv = KVStore("asp", context=ctx)
        kv.init("w", np.zeros((4, 2), dtype=np.float32))
        with pytest.raises(ValueError, match=r"\(4, 2\) float32"):
            kv.push("w", np.zeros(3, dtype=np.float32))
        with pytest.raises(ValueError, match="float32"):
            kv.push("w", np.zeros((4, 2), dtype=np.float64))
        with pytest.raises(KeyError, match="unknown key"):
            kv.pull("nope")
        with pytest.raises(IndexError):
            kv.push_rows("w", np.array([9]), np.zeros((1, 2), dtype=np.float32))
        # bypass the client's checks: the server itself must refuse, answer with an error, and keep serving
        t = ctx.transport
        server = ctx.settings.num_workers
        for i, (meta, arrays) in enumerate(
            [
                ({"op": "push", "key": "w", "chunk": 0}, [np.zeros(5, dtype=np.float32)]),
                ({"op": "push", "key": "ghost", "chunk": 0}, [np.zeros(1)]),
                ({"op": "teleport"}, []),
                ({"op": "pull", "key": "w", "chunk": 0, "rows": True}, [np.array([99])]),
            ]
        ):
            rid = 1_000_000 * (ctx.rank + 1) + i
            t.send(server, REQUEST_TAG, arrays, {**meta, "id": rid})
            assert "error" in t.recv(server, reply_tag(rid), timeout=20).meta
        kv.push("w", np.ones((4, 2), dtype=np.float32)).wait(20)
        ctx.barrier()
        value = kv.pull("w")
        kv.close()
        return str(value.sum())

    assert run_ranks(2, worker, servers=1) == ["16.0", "16.0"]


def test_init_mismatch_and_missing_servers() -> None:
    def worker(ctx: Context) -> None:
        kv = KVStore(context=ctx)
        if ctx.rank == 0:
            kv.init("w", np.zeros(3))
        else:
            with pytest.raises(PSRequestError, match="every worker must init a key alike"):
                kv.init("w", np.zeros(4))
        ctx.barrier()
        kv.close()

    run_ranks(2, worker, servers=1)
    with pytest.raises(ConfigError, match="no parameter servers"):
        run_ranks(1, lambda ctx: KVStore(context=ctx))


@pytest.mark.parametrize(("consistency", "staleness"), [("bsp", None), ("ssp", 0), ("ssp", 2)])
def test_server_side_optimizer_takes_one_step_per_clock(consistency: str, staleness: int | None) -> None:
    # In every model the server averages a clock's gradients and takes one SGD step; the result equals a single
    # process doing SGD on the mean gradient (SSP(2) only reads staler values, and these gradients are constant).
    lr, clocks, workers = 0.1, 4, 3

    def worker(ctx: Context) -> np.ndarray:
        kv = KVStore(consistency, staleness, {"name": "sgd", "lr": lr, "momentum": 0.5}, context=ctx)
        kv.init("w", np.ones(5))
        for _ in range(clocks):
            kv.push("w", np.full(5, float(ctx.rank + 1))).wait(20)
            kv.clock()
        ctx.barrier()  # every clock message is on its way; a pull after it at clock 4 + s sees all 4 rounds
        for _ in range(staleness or 0):
            kv.clock()
        out = kv.pull("w")
        kv.close()
        return out

    results = run_ranks(workers, worker, servers=2)
    w, buf, g = np.ones(5), np.zeros(5), np.mean([r + 1 for r in range(workers)])
    for k in range(clocks):
        buf = g if k == 0 else 0.5 * buf + g
        w = w - lr * buf
    for r in results:
        np.testing.assert_allclose(r, w, rtol=1e-12)


def test_asp_takes_one_step_per_round_of_n_pushes() -> None:
    # Two workers, pushes ordered by barriers: worker 0 pushes twice before worker 1 pushes at all. Rounds close
    # every 2 pushes in arrival order, so 4 pushes are 2 momentum steps, each on the mean of its round.
    lr = 0.1

    def worker(ctx: Context) -> np.ndarray:
        kv = KVStore("asp", optimizer={"name": "sgd", "lr": lr, "momentum": 0.9}, context=ctx)
        kv.init("w", np.zeros(2))
        if ctx.rank == 0:
            kv.push("w", np.array([1.0, 0.0])).wait(20)
            kv.push("w", np.array([3.0, 0.0])).wait(20)
        ctx.barrier()
        if ctx.rank == 1:
            kv.push("w", np.array([0.0, 2.0])).wait(20)
            kv.push("w", np.array([0.0, 4.0])).wait(20)
        ctx.barrier()
        out = kv.pull("w")
        kv.close()
        return out

    first, second = np.array([2.0, 0.0]), np.array([0.0, 3.0])  # the means of the two rounds
    expected = -lr * first - lr * (0.9 * first + second)
    for r in run_ranks(2, worker, servers=1):
        np.testing.assert_allclose(r, expected, rtol=1e-12)


def test_staleness_aware_lr_scales_by_rounds_behind() -> None:
    # SSP(3), 2 workers; worker 1 waits (barrier) until worker 0 has pushed at clocks 0..2 having read version 0
    # once. Worker 0's gradients of clocks 1 and 2 were computed on version 0: 1 and 2 rounds stale, weights 1
    # and 1/2. Worker 1 then reads version 0 too and pushes at clock 0, 1, 2 without pulling again: the same.
    lr = 1.0

    def worker(ctx: Context, aware: bool) -> np.ndarray:
        kv = KVStore("ssp", 3, {"name": "sgd", "lr": lr}, context=ctx, staleness_lr=aware, cache=False)
        kv.init("w", np.zeros(1))
        if ctx.rank == 1:
            ctx.barrier()
        kv.pull("w")
        for _ in range(3):
            kv.push("w", np.ones(1)).wait(20)
            kv.clock()
        if ctx.rank == 0:
            ctx.barrier()
        for _ in range(3):
            kv.clock()
        out = kv.pull("w")  # at clock 6 with s = 3 it needs min(done) >= 3: all three rounds applied
        kv.close()
        return out

    plain = run_ranks(2, lambda ctx: worker(ctx, False), servers=1)
    aware = run_ranks(2, lambda ctx: worker(ctx, True), servers=1)
    for r in plain:
        np.testing.assert_allclose(r, [-3.0])  # three rounds, each the mean of two gradients of 1
    for r in aware:
        np.testing.assert_allclose(r, [-(1.0 + 1.0 + 0.5)])


def test_over_real_sockets() -> None:
    def worker(ctx: Context) -> float:
        kv = KVStore("ssp", 1, context=ctx)
        kv.init("w", np.zeros(1 << 16))
        for _ in range(3):
            kv.push("w", np.ones(1 << 16))
            kv.clock()
        ctx.barrier()
        kv.clock()
        kv.clock()
        out = float(kv.pull("w").sum())
        kv.close()
        return out

    assert run_ranks(2, worker, servers=2, transport="zmq") == [6.0 * (1 << 16)] * 2


def test_worker_leaves_and_rejoins_between_clocks() -> None:
    # Worker 1 leaves after 2 clocks; BSP goes on with the others; it comes back and is counted again from the
    # slowest clock of the others, so nobody waits for the clocks it missed.
    def worker(ctx: Context) -> int:
        kv = KVStore("bsp", context=ctx)
        kv.init("x", np.zeros(1, dtype=np.int64))
        for _ in range(2):
            kv.push("x", np.ones(1, dtype=np.int64))
            kv.clock()
        if ctx.rank == 1:
            kv.close()
            ctx.barrier()  # the others run 3 clocks without it
            ctx.barrier()
            kv = KVStore("bsp", context=ctx, join=True)
            kv.init("x", np.zeros(1, dtype=np.int64))
            joined_at = kv.clock_value
            ctx.barrier()  # joined: the others may go on (else their next clock could race the join)
        else:
            ctx.barrier()
            for _ in range(3):
                kv.push("x", np.ones(1, dtype=np.int64))
                kv.clock()
            ctx.barrier()
            ctx.barrier()
            joined_at = kv.clock_value
        kv.push("x", np.ones(1, dtype=np.int64))
        kv.clock()
        value = int(kv.pull("x")[0])
        kv.close()
        return joined_at * 100 + value

    # worker 1 rejoins at clock 5 (the others'); final value: 3x2 + 2x3 + 3x1 = 15
    assert run_ranks(3, worker, servers=2) == [515, 515, 515]


def test_sparse_rows_with_an_async_optimizer_move_only_those_rows() -> None:
    def worker(ctx: Context) -> np.ndarray:
        kv = KVStore("asp", optimizer={"name": "adam", "lr": 0.1}, context=ctx)
        kv.init("emb", np.ones((6, 2), dtype=np.float32))
        kv.push_rows("emb", np.array([1, 4]), np.ones((2, 2), dtype=np.float32)).wait(20)
        ctx.barrier()
        out = kv.pull("emb")
        kv.close()
        return out

    for out in run_ranks(2, worker, servers=2):
        untouched = [0, 2, 3, 5]
        np.testing.assert_array_equal(out[untouched], np.ones((4, 2), dtype=np.float32))
        # one round of two pushes: one lazy Adam step on rows 1 and 4, whose first step moves each by lr
        np.testing.assert_allclose(out[[1, 4]], np.full((2, 2), 0.9, dtype=np.float32), rtol=1e-6)


def test_a_worker_that_shuts_down_without_close_is_not_reported_as_crashed(caplog: pytest.LogCaptureFixture) -> None:
    def worker(ctx: Context) -> int:
        kv = KVStore("bsp", context=ctx)
        kv.init("w", np.zeros(2))
        kv.push("w", np.ones(2)).wait(20)
        kv.clock()
        if ctx.rank == 1:
            ctx.transport.close()  # leaves without kv.close(): says goodbye, as a process exiting normally does
            return -1
        kv.clock()  # the server lets worker 0 go on without worker 1
        out = int(kv.pull("w")[0])
        kv.close()
        return out

    with caplog.at_level(logging.INFO, logger="paratrain.ps.server"):
        assert run_ranks(2, worker, servers=1, transport="zmq") == [2, -1]
    assert "worker 1 shut down without kv.close()" in caplog.text
    assert "crashed" not in caplog.text


@pytest.mark.parametrize(
    ("consistency", "staleness", "eager"),
    [("ssp", 0, False), ("bsp", None, False), ("ssp", 2, True), ("asp", None, True)],
)
def test_reads_preview_open_rounds_only_when_staleness_is_allowed(
    consistency: str, staleness: int | None, eager: bool
) -> None:
    # Worker 0 pushes at clock 0 while worker 1 has not pushed: the round is open. Under SSP(2) and ASP worker
    # 0's read previews it (its own gradient, read-my-writes), without applying it; under BSP/SSP(0) the read
    # waits, so it is made only after worker 1's push and clock, and sees the applied round.
    def worker(ctx: Context) -> tuple[float, float]:
        kv = KVStore(consistency, staleness, {"name": "sgd", "lr": 1.0}, context=ctx, cache=False)
        kv.init("w", np.zeros(1))
        first = -1.0
        if eager and ctx.rank == 1:
            ctx.barrier()  # worker 0 pushes, clocks and reads first
        kv.push("w", np.array([4.0 if ctx.rank == 0 else 2.0])).wait(20)
        kv.clock()
        if eager and ctx.rank == 0:
            first = float(kv.pull("w")[0])
            ctx.barrier()
        for _ in range(2):
            kv.clock()  # to clock 3: the round of clock 0 is complete under every model before the last read
        ctx.barrier()
        last = float(kv.pull("w")[0])
        kv.close()
        return first, last

    results = run_ranks(2, worker, servers=1)
    if eager:
        assert results[0][0] == -4.0  # the preview: one step on the mean of what the open round holds
    for _, last in results:
        assert last == -3.0  # the round applied once, on the mean (4 + 2) / 2
