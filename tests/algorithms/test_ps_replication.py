"""Replicated parameter servers (``replicas=2``): replicas agree, nothing changes but the cost, and a server's
death loses no acknowledged update and applies none twice (in-process ranks; a server is killed by aborting its
transport, as a crash would)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from paratrain import Context
from paratrain._arrays import WireArray
from paratrain.errors import ConfigError
from paratrain.ps import KVStore
from paratrain.ps.protocol import REQUEST_TAG, PSRequestError, pack, reply_tag
from paratrain.ps.resync import catch_up
from paratrain.ps.server import ParameterServer, ServerStats
from paratrain.testing import rank_context, run_ranks
from paratrain.transport.base import Handle, Transport
from paratrain.transport.inproc import InprocFabric
from paratrain.transport.registry import local_job
from paratrain.transport.wire import Message

pytestmark = pytest.mark.timeout(90)

SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.5}


def _grad(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    """A gradient that depends on the parameters, with exact (dyadic) sums in any order."""
    return np.floor(np.sin(w * (rank + 1) + step) * 8) / 8


def _train(replicas: int, *, steps: int = 5, check: bool = False) -> Callable[[Context], Any]:
    def worker(ctx: Context) -> tuple[np.ndarray, list[bool]]:
        kv = KVStore(optimizer=SGD, context=ctx, replicas=replicas, chunk_bytes=64)  # 8 rows a chunk
        kv.init("w", np.arange(40, dtype=np.float64) / 8)
        agree = []
        for step in range(steps):
            w = kv.pull("w")
            kv.push("w", _grad(w, ctx.rank, step))
            kv.clock()
            if check:
                copies = kv.pull_replicas("w")
                agree.append(all(np.array_equal(copies[0], c) for c in copies[1:]))
                kv.clock()  # nobody pushes again before every worker has compared the copies
        out = kv.pull("w")
        kv.close()
        return out, agree

    return worker


@pytest.mark.parametrize("servers", [2, 3])
def test_replicated_bsp_equals_unreplicated_and_replicas_agree_after_every_clock(servers: int) -> None:
    plain = run_ranks(3, _train(1), servers=servers)
    replicated = run_ranks(3, _train(2, check=True), servers=servers)
    for (a, _), (b, agree) in zip(plain, replicated, strict=True):
        np.testing.assert_array_equal(a, b)
        assert agree == [True] * 5


def test_replicated_sums_dense_and_rows() -> None:
    def worker(ctx: Context) -> tuple[np.ndarray, np.ndarray, list[bool]]:
        kv = KVStore(context=ctx, replicas=3, chunk_bytes=64)
        kv.init("d", np.zeros(50, dtype=np.int64))
        kv.init("t", np.zeros((20, 2), dtype=np.int64))
        agree = []
        for c in range(4):
            kv.push("d", np.arange(50, dtype=np.int64) * (ctx.rank + 1))
            kv.push_rows("t", np.array([c, 19 - c, c]), np.ones((3, 2), dtype=np.int64))
            kv.clock()
            copies = kv.pull_replicas("d") + kv.pull_replicas("t")
            agree.append(all(np.array_equal(copies[i], copies[j]) for i, j in ((0, 1), (0, 2), (3, 4), (3, 5))))
            kv.clock()
        out = kv.pull("d"), kv.pull_rows("t", np.arange(20))
        kv.close()
        return out[0], out[1], agree

    for d, t, agree in run_ranks(2, worker, servers=3):
        np.testing.assert_array_equal(d, np.arange(50) * 3 * 4)
        expected = np.zeros((20, 2), dtype=np.int64)
        for c in range(4):
            np.add.at(expected, [c, 19 - c, c], 2)
        np.testing.assert_array_equal(t, expected)
        assert agree == [True] * 4


def test_bfloat16_pushes_reach_the_backups_as_bfloat16() -> None:
    """A bfloat16 push (a gradient compressed for the wire) is forwarded under its name: the owner holds it as its
    16-bit pattern (uint16), and forwarded as that it was rejected by the backup ("carries uint16")."""
    one = np.full(40, 0x3F80, dtype=np.uint16)  # 1.0 in bfloat16

    def worker(ctx: Context) -> tuple[np.ndarray, list[np.ndarray]]:
        kv = KVStore(context=ctx, replicas=2, chunk_bytes=64)
        kv.init("w", np.zeros(40, dtype=np.float32))
        for _ in range(3):
            kv.push("w", WireArray(one, "bfloat16")).wait(30)
            kv.clock()
        out, copies = kv.pull("w"), kv.pull_replicas("w")
        kv.close()
        return out, copies

    for out, copies in run_ranks(2, worker, servers=2):
        np.testing.assert_array_equal(out, np.full(40, 6.0, dtype=np.float32))
        for copy in copies:
            np.testing.assert_array_equal(copy, out)


def test_replicas_outside_the_servers_is_an_error() -> None:
    def worker(ctx: Context) -> None:
        with pytest.raises(ConfigError, match="replicas=3"):
            KVStore(context=ctx, replicas=3)

    run_ranks(1, worker, servers=2)


# -- a server dies ---------------------------------------------------------------------------------------------


class _Servers:
    """The parameter servers of an in-process job, as a test may fail them: ``kill(i)`` crashes server ``i`` (its
    transport aborts, as a killed process's connections drop) and returns when it did; ``restart(i)`` starts it
    again as a restarted process would (a new endpoint of its rank, :meth:`InprocFabric.rejoin`), catching up from
    the other replicas before it serves."""

    def __init__(self, fabric: InprocFabric, transports: list[Transport], workers: int, timeout: float) -> None:
        self.fabric, self.transports, self.workers, self.timeout = fabric, transports, workers, timeout
        self.stats: dict[int, ServerStats] = {}  # each server's latest process's
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    def __call__(self, index: int = 0) -> float:
        return self.kill(index)

    def kill(self, index: int = 0) -> float:
        with self._lock:
            self.transports[self.workers + index].abort()
            return time.monotonic()

    def restart(self, index: int = 0) -> None:
        with self._lock:
            rank = self.workers + index
            self.transports[rank] = self.fabric.rejoin(rank)
            self.start(rank, rejoin=True)

    def start(self, rank: int, *, rejoin: bool = False) -> None:
        thread = threading.Thread(target=self._serve, args=(self.transports[rank], rejoin), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _serve(self, transport: Transport, rejoin: bool) -> None:
        rank = transport.rank
        servers = transport.world_size - self.workers
        ctx = rank_context(transport, workers=self.workers, servers=servers, timeout=self.timeout)
        try:
            server = ParameterServer(transport, num_workers=self.workers, timeout=self.timeout, rejoin=rejoin)
            stats = server.serve()
            if self.transports[rank] is transport:  # not a killed predecessor returning late
                self.stats[rank - self.workers] = stats
        except BaseException as exc:
            self.errors.append(exc)
            self.fabric.fail_all(exc)
        finally:
            ctx.shutdown()


def _run_with_kill(
    workers: int,
    servers: int,
    fn: Callable[[Context, _Servers], Any],
    *,
    timeout: float = 60.0,
    wrap: Callable[[list[Transport]], None] | None = None,
) -> tuple[list[Any], list[ServerStats | None]]:
    """Runs ``fn(ctx, servers)`` on in-process workers beside parameter-server threads (:class:`_Servers`: call
    it to kill the first server). ``wrap(transports)`` may wrap the job's transports before anyone starts (to
    order messages). Returns the workers' results and each server's latest process's stats."""
    total = workers + servers
    fabric = InprocFabric(total, timeout=timeout)
    transports: list[Transport] = [fabric.transport(r) for r in range(total)]
    if wrap is not None:
        wrap(transports)
    job = _Servers(fabric, transports, workers, timeout)
    results: list[Any] = [None] * workers

    def body(rank: int) -> None:
        ctx = rank_context(transports[rank], workers=workers, servers=servers, timeout=timeout)
        try:
            results[rank] = fn(ctx, job)
        except BaseException as exc:
            job.errors.append(exc)
            fabric.fail_all(exc)
        finally:
            ctx.shutdown()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(workers)]
    for rank in range(workers, total):
        job.start(rank)
    for t in threads:
        t.start()
    for t in [*threads, *job.threads]:
        t.join(timeout)
    for t in job.transports:
        t.abort()
    assert not [t for t in [*threads, *job.threads] if t.is_alive()], "a rank hung"
    if job.errors:
        raise job.errors[0]
    return results, [job.stats.get(i) for i in range(servers)]


@pytest.mark.parametrize("kill_at", [0, 2, 4])
def test_a_killed_server_fails_over_and_the_model_equals_the_fault_free_run(kill_at: int) -> None:
    steps = 6
    expected = run_ranks(3, _train(1, steps=steps), servers=3)[0][0]

    def worker(ctx: Context, kill: _Servers) -> tuple[np.ndarray, int]:
        kv = KVStore(optimizer=SGD, context=ctx, replicas=2, chunk_bytes=64)
        kv.init("w", np.arange(40, dtype=np.float64) / 8)
        for step in range(steps):
            w = kv.pull("w")
            handle = kv.push("w", _grad(w, ctx.rank, step))
            if step == kill_at and ctx.rank == 0:
                kill()  # while pushes are in flight
            handle.wait(30)
            kv.clock()
        out = kv.pull("w")
        kv.close()
        return out, kv.failovers

    results, stats = _run_with_kill(3, 3, worker)
    for out, _ in results:
        np.testing.assert_array_equal(out, expected)
    assert sum(f for _, f in results) > 0
    assert all(s is not None and s.servers_lost == [3] for s in stats[1:])


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize(("consistency", "staleness"), [("bsp", None), ("ssp", 2), ("asp", None)])
def test_audit_no_update_lost_or_applied_twice_across_a_server_kill(
    consistency: str, staleness: int | None, restart: bool
) -> None:
    """Every worker adds 1 to every element of an integer key once per clock; a server dies mid-run (with
    ``restart``: it is restarted and catches up, then the other replica of its chunks dies). ASP has no clock
    bound: there each worker waits for every push's acknowledgement (it is then on every live replica) and the
    workers meet before reading."""
    workers, clocks, size = 3, 12, 64

    def worker(ctx: Context, job: _Servers) -> tuple[np.ndarray, list[np.ndarray]]:
        kv = KVStore(consistency, staleness, context=ctx, replicas=2, chunk_bytes=64)
        kv.init("n", np.zeros(size, dtype=np.int64))
        for c in range(clocks):
            pushed = kv.push("n", np.ones(size, dtype=np.int64))
            if consistency == "asp":
                pushed.wait(30)
            if ctx.rank == 1 and c == (3 if restart else clocks // 2):
                job.kill(0)
                if restart:
                    job.restart(0)
            if ctx.rank == 1 and restart and c == 8:
                assert kv.resyncs == 1  # it fenced, at its first pull after the restart
                job.kill(1)
            kv.clock()
            if restart:
                kv.pull("n")  # a wait: the fence of the restarted server happens here at the latest
        if consistency == "asp":
            ctx.barrier()
        for _ in range(0 if consistency == "asp" else 1 + (staleness or 0)):  # then a read reflects every push
            kv.clock()
        out = kv.pull("n")
        copies = kv.pull_replicas("n")
        kv.close()
        return out, copies

    results, stats = _run_with_kill(workers, 3, worker)
    for out, copies in results:
        np.testing.assert_array_equal(out, np.full(size, workers * clocks))  # none lost, none applied twice
        for copy in copies:
            np.testing.assert_array_equal(copy, out)
    if not restart:
        assert all(s is not None and s.servers_lost == [3] for s in stats[1:])


# -- a clock that overtakes the pushes forwarded to a backup ---------------------------------------------------


def _forwards_after_clocks(workers: int, transports: list[Transport]) -> None:
    """Makes every push a server forwards reach the other server only after that server received the pushing
    worker's clock for it: the order the worker's clock, sent without waiting for acknowledgements, allows.

    A forward (``replicate``) is held back at its sender until its receiver has seen the worker's clock
    ``wclock + 1``; that receiver sends it on itself, in the same call that returns the clock to its loop, so the
    loop always handles the clock first. Deterministic: an order of messages, no timing."""
    lock = threading.Lock()
    clocks: dict[tuple[int, int], int] = {}  # (server rank, worker) -> the last clock it received
    held: list[tuple[Callable[..., Handle[None]], int, int, Any, dict[str, Any]]] = []

    def due(dst: int, meta: dict[str, Any]) -> bool:
        first = meta["ops"][0] if meta["op"] == "replicate_batch" else meta  # a batch's: one worker's, one clock's
        return clocks.get((dst, first["worker"]), 0) >= first["wclock"] + 1

    for t in transports[workers:]:
        send, receive = t.isend, t.recv

        def isend(dst: int, tag: int, arrays: Any = (), meta: Any = None, *, send: Any = send) -> Handle[None]:
            if meta is not None and meta.get("op") in ("replicate", "replicate_batch"):
                with lock:
                    if not due(dst, meta):
                        held.append((send, dst, tag, list(arrays), dict(meta)))
                        return Handle.completed(None)
            result: Handle[None] = send(dst, tag, arrays, meta)
            return result

        def recv(
            src: int, tag: int, timeout: float | None = None, *, receive: Any = receive, me: int = t.rank
        ) -> Message:
            msg: Message = receive(src, tag, timeout=timeout)
            if msg.meta.get("op") == "clock":
                with lock:
                    clocks[(me, msg.src)] = msg.meta["clock"]
                    ready = [h for h in held if h[1] == me and due(me, h[4])]
                    held[:] = [h for h in held if not (h[1] == me and due(me, h[4]))]
                for send_, dst, tag_, arrays, meta in ready:
                    send_(dst, tag_, arrays, meta)
            return msg

        t.isend = isend  # type: ignore[method-assign]
        t.recv = recv  # type: ignore[method-assign]


def test_a_clock_reaching_a_backup_before_its_forwarded_pushes_is_counted_after_them() -> None:
    """The worker sends its clock without waiting for its pushes' acknowledgements; a server counts it only when
    it holds every push of that clock it replicates, so the replicated run still equals the unreplicated one."""
    workers, steps = 2, 4
    expected = run_ranks(workers, _train(1, steps=steps), servers=2)[0][0]

    def worker(ctx: Context, kill: _Servers) -> tuple[np.ndarray, list[np.ndarray]]:
        kv = KVStore(optimizer=SGD, context=ctx, replicas=2, chunk_bytes=64)
        kv.init("w", np.arange(40, dtype=np.float64) / 8)
        for step in range(steps):
            w = kv.pull("w")
            kv.push("w", _grad(w, ctx.rank, step))
            kv.clock()
        out = kv.pull("w")
        copies = kv.pull_replicas("w")
        kv.close()
        return out, copies

    results, stats = _run_with_kill(workers, 2, worker, wrap=functools.partial(_forwards_after_clocks, workers))
    for out, copies in results:
        np.testing.assert_array_equal(out, expected)
        for copy in copies:
            np.testing.assert_array_equal(copy, out)
    assert all(s is not None and s.clocks_held > 0 and s.replicated > 0 for s in stats)
    # a server tells its backup of a worker's batch of pushes in one message (chunks 0, 2, 4 on server 0)...
    assert all(s is not None and s.forward_messages < s.forwarded for s in stats)
    # ... and sends each chunk's state once per round, whatever the number of workers (5 chunks, 4 rounds)
    assert sum(s.states_sent for s in stats if s is not None) == 5 * steps


def _corrupt_pushes_of_clock(worker: int, wclock: int, transports: list[Transport]) -> None:
    """Worker ``worker``'s pushes made at clock ``wclock`` leave with float64 data for an int64 key (a fault on its
    wire, after the KVStore's own checks), so their owner rejects them."""
    t = transports[worker]
    send = t.isend

    def isend(dst: int, tag: int, arrays: Any = (), meta: Any = None) -> Handle[None]:
        if meta is not None and meta.get("op") == "push" and meta.get("wclock") == wclock:
            arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
        result: Handle[None] = send(dst, tag, arrays, meta)
        return result

    t.isend = isend  # type: ignore[method-assign]


def test_a_push_its_owner_rejects_does_not_hold_back_the_clock_on_its_backup() -> None:
    """The owner tells the backups to count a push it rejected (``skip``), else a backup would wait for it forever
    before counting the worker's clock; the worker gets the rejection, and no replica applied the push."""
    workers, clocks = 2, 3

    def worker(ctx: Context, kill: _Servers) -> tuple[np.ndarray, list[np.ndarray], int]:
        kv = KVStore(context=ctx, replicas=2, chunk_bytes=64)  # 2 chunks: each server owns one, backs up the other
        kv.init("n", np.zeros(16, dtype=np.int64))
        errors = 0
        for c in range(clocks):
            handle = kv.push("n", np.ones(16, dtype=np.int64))
            if c == 1 and ctx.rank == 0:
                with pytest.raises(PSRequestError, match="carries float64"):
                    handle.wait(30)
                with pytest.raises(PSRequestError):
                    kv.clock()  # sent and counted, then the rejection is raised
                errors += 1
            else:
                kv.clock()
        out = kv.pull("n")
        copies = kv.pull_replicas("n")
        kv.close()
        return out, copies, errors

    results, stats = _run_with_kill(workers, 2, worker, wrap=functools.partial(_corrupt_pushes_of_clock, 0, 1))
    for out, copies, _ in results:
        np.testing.assert_array_equal(out, np.full(16, workers * clocks - 1))  # worker 0's clock-1 push is lost
        for copy in copies:
            np.testing.assert_array_equal(copy, out)
    assert [e for _, _, e in results] == [1, 0]
    assert all(s is not None and s.rejected == 1 for s in stats)


def _serve_until_leave(job: Any, *, replies: Sequence[int] = ()) -> tuple[ParameterServer, ServerStats]:
    """Runs server B (rank 2) of ``job`` over the messages queued in its mailbox; a correct server returns at the
    worker's ``leave``, one that keeps a request held back runs into the 20 s safety net (a failure). The answers
    to the worker's requests ``replies`` are received before the job ends (``server.answers``)."""
    server = ParameterServer(job.transports[2], num_workers=1, timeout=10.0, poll=0.05)
    stop = threading.Event()
    timer = threading.Timer(20.0, stop.set)
    timer.start()
    try:
        stats = server.serve(stop)
        server.answers = [job.transports[0].recv(2, reply_tag(i), timeout=5.0) for i in replies]  # type: ignore[attr-defined]
    finally:
        timer.cancel()
        for t in job.transports:
            t.abort()
    assert not stop.is_set(), "a request stayed held back"
    return server, stats


def test_a_push_sent_again_behind_a_later_held_back_clock_is_applied_when_an_earlier_clock_is_released() -> None:
    """Regression (the audit under SSP(2) hung about 1 run in 6): server B held back worker 0's clock 1, waiting
    for a push forwarded by owner A; A died, and the worker sent that push, and a push of its clock 1 (which clock 2
    waits for), to B itself, the second one first. The second arrived while clock 1 was the first held back, so it
    was held back too; once clock 1 was released, it must not stay held back behind clock 2, which waits for it.

    The worker's messages are queued in B's mailbox in this order before B's loop runs; the loop ends when the
    worker's final ``leave`` is handled, i.e. only if nothing stays held back."""
    job = local_job("inproc", 3, timeout=10.0)  # worker 0, server A = rank 1 (dead: nobody serves it), B = rank 2
    worker = job.transports[0]

    def send(arrays: list[np.ndarray], **meta: Any) -> None:
        worker.isend(2, REQUEST_TAG, arrays, {"id": 0, **meta})

    def push(chunk: int, seq: int, wclock: int) -> None:
        send([np.full(8, 10**seq, dtype=np.int64)], op="push", key="k", chunk=chunk, seq=seq, wclock=wclock, version=0)

    init = {"op": "init", "key": "k", "dtype": "int64", "shape": [8], "key_shape": [16], "consistency": "ssp"}
    send([np.zeros(8, dtype=np.int64)], **init, chunk=0, replicas=[1, 2])  # chunk 0: owner A, backup B
    send([np.zeros(8, dtype=np.int64)], **init, chunk=1, replicas=[2, 1])  # chunk 1: owner B, backup A
    push(1, seq=1, wclock=0)
    send([], op="clock", clock=1, expect=2)  # held back: chunk 0's push (seq 0) was to come forwarded by A
    push(1, seq=3, wclock=1)
    send([], op="clock", clock=2, expect=2)
    push(0, seq=2, wclock=1)  # sent again to B after A died, before seq 0: held back behind clock 1
    push(0, seq=0, wclock=0)  # sent again to B: releases clock 1, then seq 2 must release clock 2
    send([], op="leave")
    server, stats = _serve_until_leave(job)
    assert server.done[0] == 2 and stats.clocks_held == 2 and stats.pushes == 4
    np.testing.assert_array_equal(server._chunks[("k", 0)].value, np.full(8, 1 + 100))
    np.testing.assert_array_equal(server._chunks[("k", 1)].value, np.full(8, 10 + 1000))


def test_a_batch_of_pushes_sent_again_is_not_held_back_behind_the_clock_it_completes() -> None:
    """A worker's pushes to a dead owner fail over as one batch (the chunks that owner held): when they reach the
    backup behind the worker's clock that waits for them, the batch is applied at once, as a single retried push
    would be, and releases the clock. Held back behind it, the clock would never be counted."""
    job = local_job("inproc", 3, timeout=10.0)  # worker 0, server A = rank 1 (dead: nobody serves it), B = rank 2
    worker = job.transports[0]
    init = {"op": "init", "key": "k", "dtype": "int64", "shape": [8], "key_shape": [24], "consistency": "bsp"}

    def send(arrays: list[np.ndarray], **meta: Any) -> None:
        worker.isend(2, REQUEST_TAG, arrays, {"id": 0, **meta})

    def push(chunk: int, seq: int) -> tuple[dict[str, Any], list[np.ndarray]]:
        meta = {"op": "push", "key": "k", "chunk": chunk, "seq": seq, "wclock": 0, "version": 0}
        return {**meta, "id": 10 + seq}, [np.full(8, 10**seq, dtype=np.int64)]

    for chunk, replicas in ((0, [1, 2]), (1, [2, 1]), (2, [1, 2])):  # A owns chunks 0 and 2, B chunk 1
        send([np.zeros(8, dtype=np.int64)], **init, chunk=chunk, replicas=replicas)
    meta, data = push(1, seq=1)
    send(data, **meta)
    send([], op="clock", clock=1, expect=3)  # held back: chunks 0 and 2 were to come forwarded by A
    ops, arrays = pack([push(0, seq=0), push(2, seq=2)])
    send(arrays, op="batch", ops=ops)  # both sent again to B, in one batch, after A died
    send([], op="leave")
    server, stats = _serve_until_leave(job)
    assert server.done[0] == 1 and stats.clocks_held == 1 and stats.pushes == 3 and stats.batches == 1
    for chunk in range(3):
        np.testing.assert_array_equal(server._chunks[("k", chunk)].value, np.full(8, 10**chunk))


def test_a_backup_that_takes_over_waits_for_the_pushes_its_owner_had_and_puts_them_in_their_rounds() -> None:
    """Under BSP a backup learns of each push from its owner at once (a ``notice``) and gets the data only in the
    owner's state once the round is complete. Owner A applied worker 0's clock-0 push, told backup B, and died
    before its state went out: B has counted the worker's clock 1, but a pull of clock 1 must wait for the push,
    which the worker sends again to B, and the push joins round 0, the round A had put it in (B's own clock
    bookkeeping would put it in round 1, which is not complete, and the pull would read the value without it)."""
    job = local_job("inproc", 3, timeout=10.0)  # worker 0, server A = rank 1 (it only sends the notice), B = rank 2
    worker, owner = job.transports[0], job.transports[1]
    init = {"op": "init", "key": "k", "chunk": 0, "dtype": "float64", "shape": [8], "key_shape": [8]}
    init |= {"consistency": "bsp", "replicas": [1, 2], "optimizer": {"name": "sgd", "lr": 0.5}}
    worker.isend(2, REQUEST_TAG, [np.zeros(8)], {**init, "id": 0})
    notice = {"op": "notice", "id": -1, "key": "k", "chunk": 0, "worker": 0, "seq": 0, "wclock": 0, "round": 0}
    owner.isend(2, REQUEST_TAG, [], notice)
    worker.isend(2, REQUEST_TAG, [], {"op": "clock", "id": -1, "clock": 1, "expect": 1})  # counted: B holds 1
    worker.isend(2, REQUEST_TAG, [], {"op": "pull", "id": 1, "key": "k", "chunk": 0, "required": 1})
    push = {"op": "push", "id": 2, "key": "k", "chunk": 0, "seq": 0, "wclock": 0, "version": 0}
    worker.isend(2, REQUEST_TAG, [np.ones(8)], push)  # sent again after A died
    worker.isend(2, REQUEST_TAG, [], {"op": "leave", "id": 3})
    server, _ = _serve_until_leave(job, replies=[1])
    (pulled,) = server.answers  # type: ignore[attr-defined]
    np.testing.assert_array_equal(pulled.arrays[0], np.full(8, -0.5))  # one SGD step on the push: 0 - 0.5 * 1
    assert not server._chunks[("k", 0)].awaited


def test_a_state_that_overtakes_the_notice_of_its_push_counts_the_push_once() -> None:
    """An owner may send a chunk's state while handling a worker's batch, before that batch's notices (a push sent
    again for a round already complete goes out at once): the backup counts the push towards its worker's clock
    when the state brings it, and the late notice counts nothing, so the clock is neither held back forever nor
    counted early."""
    job = local_job("inproc", 3, timeout=10.0)  # worker 0, owner A = rank 1 (sends a state, then a notice), B = 2
    worker, owner = job.transports[0], job.transports[1]
    init = {"op": "init", "key": "k", "chunk": 0, "dtype": "int64", "shape": [8], "key_shape": [8]}
    worker.isend(2, REQUEST_TAG, [np.zeros(8, dtype=np.int64)], {**init, "id": 0, "replicas": [1, 2]})
    state = {"op": "replicate_state", "id": 7, "key": "k", "chunk": 0, "dtype": "int64", "key_shape": [8]}
    state |= {"optimizer": None, "consistency": "bsp", "version": 0, "replicas": [1, 2], "state": [], "rounds": []}
    ops, arrays = pack([(state | {"pushes": [[0, 0, 0]]}, [np.ones(8, dtype=np.int64)])])
    owner.isend(2, REQUEST_TAG, arrays, {"op": "replicate_states", "id": -1, "ops": ops})
    worker.isend(2, REQUEST_TAG, [], {"op": "clock", "id": -1, "clock": 1, "expect": 1})
    notice = {"op": "notice", "id": -1, "key": "k", "chunk": 0, "worker": 0, "seq": 0, "wclock": 0, "round": 0}
    owner.isend(2, REQUEST_TAG, [], notice)
    worker.isend(2, REQUEST_TAG, [], {"op": "clock", "id": -1, "clock": 2, "expect": 1})  # waits for seq 1
    notice = {**notice, "seq": 1, "wclock": 1, "round": 1}
    owner.isend(2, REQUEST_TAG, [], notice)
    worker.isend(2, REQUEST_TAG, [], {"op": "leave", "id": 1})
    server, stats = _serve_until_leave(job)
    assert server.done[0] == 2 and stats.clocks_held == 1  # clock 2 waited for the notice of seq 1, clock 1 not
    np.testing.assert_array_equal(server._chunks[("k", 0)].value, np.ones(8, dtype=np.int64))


def test_a_state_for_a_chunk_owned_here_is_refused_not_installed() -> None:
    """Two servers own one chunk only when a worker took a live server for dead. A state would then overwrite
    pushes this owner applied and answered, so it is refused (the sender's workers get the error) and the copy
    stays."""
    job = local_job("inproc", 3, timeout=10.0)  # worker 0, server A = rank 1 (sends a state), B = rank 2
    worker, other = job.transports[0], job.transports[1]
    init = {"op": "init", "key": "k", "chunk": 0, "dtype": "int64", "shape": [8], "key_shape": [8]}
    worker.isend(2, REQUEST_TAG, [np.zeros(8, dtype=np.int64)], {**init, "id": 0, "replicas": [2, 1]})
    push = {"op": "push", "id": 1, "key": "k", "chunk": 0, "seq": 0, "wclock": 0, "version": None}
    worker.isend(2, REQUEST_TAG, [np.ones(8, dtype=np.int64)], push)  # B owns chunk 0 now
    state = {"op": "replicate_state", "id": 7, "key": "k", "chunk": 0, "dtype": "int64", "key_shape": [8]}
    state |= {"optimizer": None, "consistency": "bsp", "version": 0, "replicas": [2, 1], "state": [], "rounds": []}
    ops, arrays = pack([(state | {"pushes": []}, [np.full(8, 5, dtype=np.int64)])])  # (sent by A, a backup here)
    other.isend(2, REQUEST_TAG, arrays, {"op": "replicate_states", "id": -1, "ops": ops})
    worker.isend(2, REQUEST_TAG, [], {"op": "leave", "id": 2})
    server, stats = _serve_until_leave(job)
    np.testing.assert_array_equal(server._chunks[("k", 0)].value, np.ones(8, dtype=np.int64))
    assert stats.rejected == 1


# -- a killed server restarts and catches up ------------------------------------------------------------------


ADAM = {"name": "adam", "lr": 0.25}


@pytest.mark.parametrize(
    ("servers", "optimizer", "consistency", "staleness"),
    [(2, SGD, "bsp", None), (3, SGD, "bsp", None), (3, ADAM, "bsp", None), (3, SGD, "ssp", 2)],
)
def test_a_restarted_server_catches_up_and_carries_the_job_when_the_other_replica_dies(
    servers: int, optimizer: dict[str, Any], consistency: str, staleness: int | None
) -> None:
    """Server 0 is killed and restarted; once it caught up, server 1 is killed, so the chunks they shared live on
    the restarted server alone. Every remaining replica agrees (the copy, the optimizer state, the open rounds and
    the clocks came over intact, or they would step differently), and under BSP the model is bitwise the
    fault-free run's (the gradients' sums are exact; SSP's reads depend on timing, so its runs differ anyway)."""
    steps, restart_at, second_kill_at = 10, 2, 6

    def train(ctx: Context, job: _Servers | None) -> tuple[np.ndarray, list[np.ndarray], int]:
        kv = KVStore(consistency, staleness, optimizer=optimizer, context=ctx, replicas=2, chunk_bytes=64)
        kv.init("w", np.arange(40, dtype=np.float64) / 8)
        for step in range(steps):
            w = kv.pull("w")
            kv.push("w", _grad(w, ctx.rank, step))
            kv.clock()
            if job is not None and ctx.rank == 0 and step == restart_at:
                job.kill(0)
                job.restart(0)
            if job is not None and ctx.rank == 0 and step == second_kill_at:
                assert kv.resyncs == 1  # it fenced (at its first pull after the restart), so server 0 caught up
                job.kill(1)
        for _ in range(1 + (staleness or 0)):
            kv.clock()
        out = kv.pull("w")
        copies = kv.pull_replicas("w")
        kv.close()
        return out, copies, kv.resyncs

    results, stats = _run_with_kill(3, servers, train)
    expected = run_ranks(3, lambda ctx: train(ctx, None)[0], servers=servers)[0] if consistency == "bsp" else None
    for out, copies, resyncs in results:
        np.testing.assert_array_equal(out, results[0][0])
        for copy in copies:
            np.testing.assert_array_equal(copy, out)
        if expected is not None:
            np.testing.assert_array_equal(out, expected)
        assert resyncs == 1
    restarted = stats[0]
    assert restarted is not None and restarted.catch_up_s is not None and restarted.fence_rounds >= 1
    assert restarted.servers_lost == [3 + 1]  # it saw the second kill and took over server 1's chunks
    assert sum(s.snapshots_sent for s in stats if s is not None) >= 1


def test_a_fence_round_that_cannot_complete_is_retried_not_a_deadlock() -> None:
    """Worker 1 fences (in a pull) while worker 0 waits for it in a barrier among the workers, outside the
    parameter server, so worker 0 cannot reach a fence: the round's window closes, worker 1 is released, both
    fence at their next call, and the model is still the fault-free one."""
    steps, restart_at = 6, 2

    def train(ctx: Context, job: _Servers | None) -> tuple[np.ndarray, int]:
        kv = KVStore(optimizer=SGD, context=ctx, replicas=2, chunk_bytes=64)
        kv.init("w", np.arange(40, dtype=np.float64) / 8)
        for step in range(steps):
            w = kv.pull("w")
            kv.push("w", _grad(w, ctx.rank, step))
            kv.clock()
            if job is not None and step == restart_at and ctx.rank == 0:
                job.kill(0)
                job.restart(0)
            ctx.barrier()
            if job is not None and step == restart_at and ctx.rank == 1:
                kv.pull("w")  # sees the restarted server and fences, while worker 0 waits in the next barrier
            ctx.barrier()
        out = kv.pull("w")
        kv.close()
        return out, kv.resyncs

    expected = run_ranks(2, lambda ctx: train(ctx, None)[0], servers=2)[0]
    results, stats = _run_with_kill(2, 2, train)
    for out, resyncs in results:
        np.testing.assert_array_equal(out, expected)
        assert resyncs == 1
    assert stats[0] is not None and stats[0].catch_up_s is not None and stats[0].fence_rounds >= 2  # a retry


@pytest.mark.parametrize("how", ["reply_lost", "refused_while_catching_up"])
def test_a_request_caught_in_a_restart_fails_over_and_the_restarted_server_serves_everyone(how: str) -> None:
    """Server 0 is killed and restarted while worker 1's init request to it is on its way, in the two orders a
    restart allows. ``reply_lost``: the request reached the dead process, so its failure surfaces only when worker 1
    waits for the answer, and a wait fences a restarted server first: the stale error must not make worker 1 count
    the restarted (fenced, live) server dead. It would never send it another clock, so a worker that waits for
    clocks on it waits until its timeout (the hang found with ``paratrain train --kill server0@3.8s``), and the
    job has one replica fewer than it thinks.
    ``refused_while_catching_up``: the request reached the new process before worker 1 saw the restart; the
    refusal sends it to the other replica, as a death would. Either way the restarted server serves on: when the
    other replica dies next it carries the job alone, and the model is the fault-free run's."""
    steps = 4

    def train(ctx: Context, job: _Servers | None) -> tuple[np.ndarray, int]:
        if job is not None and ctx.rank == 1:
            t, killed = ctx.transport, []
            send, receive = t.isend, t.irecv

            def restart() -> bool:
                if killed:
                    return False
                killed.append(True)
                job.kill(0)
                job.restart(0)
                return True

            def isend(dst: int, tag: int, arrays: Any = (), meta: Any = None) -> Handle[None]:
                if how == "reply_lost" and dst == 2 and meta is not None and meta.get("op") == "init" and restart():
                    return Handle.completed(None)  # it reached the process that died: no answer comes
                result: Handle[None] = send(dst, tag, arrays, meta)
                return result

            def irecv(src: int, tag: int) -> Handle[Message]:
                if how == "refused_while_catching_up" and src == 2:
                    restart()  # after worker 1 chose server 0 for its init, before it sends it there
                result: Handle[Message] = receive(src, tag)
                return result

            t.isend = isend  # type: ignore[method-assign]
            t.irecv = irecv  # type: ignore[method-assign]
        kv = KVStore(optimizer=SGD, context=ctx, replicas=2, chunk_bytes=64)
        kv.init("w", np.arange(40, dtype=np.float64) / 8)
        for step in range(steps):
            w = kv.pull("w")
            kv.push("w", _grad(w, ctx.rank, step))
            # worker 0 always reaches its clock before worker 1 does, so it waits there for worker 1's clock, on
            # server 0 (each worker waits on server rank % live servers)
            if ctx.rank == 0:
                ctx.transport.send(1, 9, meta={"step": step})
            else:
                ctx.transport.recv(0, 9)
            kv.clock()
            if job is not None and ctx.rank == 0 and step == 1:
                job.kill(1)  # the other replica: the restarted server, caught up and live, carries the job alone
        out = kv.pull("w")
        kv.close()
        return out, kv.resyncs

    expected = run_ranks(2, lambda ctx: train(ctx, None)[0], servers=2)[0]
    results, stats = _run_with_kill(2, 2, train, timeout=20)
    for out, resyncs in results:
        np.testing.assert_array_equal(out, expected)
        assert resyncs == 1
    assert stats[0] is not None and stats[0].catch_up_s is not None


def test_a_server_dying_as_init_is_sent_to_it_fails_over() -> None:
    """Server 0 dies between worker 1's check that it is live and the send of its init request: the send fails at
    once (the transport knows the peer is gone), and init goes on with the other replica, as it does when the
    answer is what fails."""

    def train(ctx: Context, job: _Servers | None) -> np.ndarray:
        if job is not None and ctx.rank == 1:
            send = ctx.transport.isend

            def isend(dst: int, tag: int, arrays: Any = (), meta: Any = None) -> Handle[None]:
                if dst == 2 and meta is not None and meta.get("op") == "init":
                    job.kill(0)
                result: Handle[None] = send(dst, tag, arrays, meta)
                return result

            ctx.transport.isend = isend  # type: ignore[method-assign]
        return _train(2, steps=3)(ctx)[0]  # type: ignore[no-any-return]

    expected = run_ranks(2, lambda ctx: train(ctx, None), servers=2)[0]
    results, _ = _run_with_kill(2, 2, train, timeout=20)
    for out in results:
        np.testing.assert_array_equal(out, expected)


def test_a_server_restarted_after_every_worker_left_stops_at_once() -> None:
    """Regression (real processes: a server killed as the job ended came back, waited the whole timeout for
    workers that had finished, and held the launcher that long): before any fence it asks the other servers which
    workers take part: none (a donor whose workers all left, or every other process gone), nothing to serve; it
    stops now, not at its timeout."""
    fabric = InprocFabric(3, timeout=10.0)  # worker 0, donor server = rank 1, the restarted server = rank 2
    donor, restarted = fabric.transport(1), fabric.transport(2)

    def answer_members() -> None:
        ask = donor.recv(2, REQUEST_TAG, timeout=10.0)
        assert ask.meta.get("op") == "members"
        donor.isend(2, reply_tag(ask.meta["id"]), (), {"live": []})

    thread = threading.Thread(target=answer_members, daemon=True)
    thread.start()
    assert catch_up(restarted, servers=[1, 2], timeout=600.0, poll=0.05) is None
    thread.join(10.0)
    donor.abort()
    fabric.transport(0).abort()  # every other process gone: the job ended
    assert catch_up(restarted, servers=[1, 2], timeout=600.0, poll=0.05) is None
    fabric.fail_all(RuntimeError("test over"))
