"""Every executor sends exactly its plan: a recording transport compares each run's messages with the plan's.

For each collective, algorithm and world size, every rank runs the call through a
:class:`~paratrain.transport.recording.RecordingTransport`; its messages (peer, bytes, in order) must equal
``plan.sends(rank)`` of the plan the cost model replays, and all of them carry the call's one tag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from paratrain.collectives.api import Collectives
from paratrain.collectives.barrier import barrier
from paratrain.collectives.lower import (
    allgather_plan,
    barrier_plan,
    broadcast_plan,
    reduce_scatter_plan,
)
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.ops import Reducer
from paratrain.collectives.plans import chunk_bounds
from paratrain.collectives.ring import ring_allreduce_run
from paratrain.collectives.shm import ShmGroup
from paratrain.collectives.tree import Exchange
from paratrain.config import Settings
from paratrain.gossip.exchange import SocketExchange
from paratrain.gossip.mixing import neighbors, resolve_mixing
from paratrain.gossip.plan import gossip_plan
from paratrain.plan import Plan
from paratrain.ps.client import KVStore
from paratrain.ps.plans import round_plan as ps_round_plan
from paratrain.ps.sharding import as_rows, plan_chunks
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.transport.recording import RecordingTransport

Call = Callable[[Collectives, int], Any]


def _recorded(n: int, call: Call, *, hosts: list[str] | None = None) -> list[list[tuple[int, int, int]]]:
    """Each rank's sends as (dst, nbytes, tag) while it runs ``call(collectives, rank)`` once."""

    def rank_fn(ctx: Context) -> list[tuple[int, int, int]]:
        rec = RecordingTransport(ctx.workers)
        coll = Collectives(transport=rec, next_tag=ctx.next_collective_tag, timeout=30, hosts=hosts)
        try:
            call(coll, ctx.rank)
        finally:
            coll.close()
        return [(m.dst, m.nbytes, m.tag) for m in rec.take()]

    return run_ranks(n, rank_fn, timeout=60)


def _assert_sent_the_plan(recorded: list[list[tuple[int, int, int]]], plan: Plan) -> None:
    plan.validate()
    for rank, sent in enumerate(recorded):
        assert [(d, b) for d, b, _ in sent] == [(m.dst, m.nbytes) for m in plan.sends(rank)], f"rank {rank}"
        assert len({tag for _, _, tag in sent}) <= 1, "one call, one tag"


WORLDS = [1, 2, 3, 4]
SIZES = [1, 7, 1000]


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_allreduce_sends_its_plan(n: int, count: int, algorithm: str) -> None:
    recorded = _recorded(n, lambda c, r: c.allreduce(np.full(count, r, np.float32), algorithm=algorithm))
    _assert_sent_the_plan(recorded, allreduce_plan(algorithm, n, count, 4) if n > 1 else Plan("none", ((),)))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_in_place_allreduce_sends_its_plan(n: int) -> None:
    recorded = _recorded(n, lambda c, r: c.allreduce_(np.full(100, r, np.float64), algorithm="direct"))
    _assert_sent_the_plan(recorded, allreduce_plan("direct", n, 100, 8, aliased=True))


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "b", "b"], ["a", "a", "a", "b", "c"]])
def test_hierarchical_allreduce_sends_its_plan(hosts: list[str]) -> None:
    n = len(hosts)
    call: Call = lambda c, r: c.allreduce(np.arange(50.0) * r, op="mean", algorithm="hierarchical")  # noqa: E731
    recorded = _recorded(n, call, hosts=hosts)
    _assert_sent_the_plan(recorded, allreduce_plan("hierarchical", n, 50, 8, hosts=tuple(hosts)))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_segmented_ring_sends_its_plan(n: int) -> None:
    """Many segments per chunk: the executor iterates the plan's segments, none of its own."""

    def rank_fn(ctx: Context) -> list[tuple[int, int, int]]:
        rec = RecordingTransport(ctx.workers)
        x = np.arange(101, dtype=np.float32) + ctx.rank
        with Exchange(rec, tag=-5, timeout=30, label="test") as ex:
            ring_allreduce_run(ex, x, x, Reducer("sum", "float32"), segment_bytes=24)
        assert np.array_equal(x, n * np.arange(101, dtype=np.float32) + n * (n - 1) / 2)
        return [(m.dst, m.nbytes, m.tag) for m in rec.take()]

    recorded = run_ranks(n, rank_fn, timeout=60)
    _assert_sent_the_plan(recorded, allreduce_plan("ring", n, 101, 4, segment_bytes=24, agreement=False))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["tree", "chain"])
def test_broadcast_sends_its_plan(n: int, algorithm: str) -> None:
    root = n - 1
    call: Call = lambda c, r: c.broadcast(np.full(300, r, np.int32), root=root, algorithm=algorithm)  # noqa: E731
    _assert_sent_the_plan(_recorded(n, call), broadcast_plan(algorithm, n, 300, 4, root=root))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter_and_allgather_send_their_plans(n: int) -> None:
    rows = 11
    bounds = tuple((a * 3, b * 3) for a, b in chunk_bounds(rows, n))
    recorded = _recorded(n, lambda c, r: c.reduce_scatter(np.ones((rows, 3))))
    _assert_sent_the_plan(recorded, reduce_scatter_plan(n, bounds, 8))
    counts = [r + 1 for r in range(n)]  # rank r contributes r + 1 rows
    offsets = np.cumsum([0, *counts]) * 2
    gather_bounds = tuple((int(offsets[i]), int(offsets[i + 1])) for i in range(n))
    recorded = _recorded(n, lambda c, r: c.allgather(np.zeros((r + 1, 2), np.int64)))
    _assert_sent_the_plan(recorded, allgather_plan(n, gather_bounds, 8))


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_barrier_sends_its_plan(n: int) -> None:
    def rank_fn(ctx: Context) -> list[tuple[int, int, int]]:
        rec = RecordingTransport(ctx.workers)
        barrier(rec, tag=-9, timeout=30)
        return [(m.dst, m.nbytes, m.tag) for m in rec.take()]

    _assert_sent_the_plan(run_ranks(n, rank_fn, timeout=60), barrier_plan(n))


# -- parameter server and gossip ---------------------------------------------------------------------------------


@dataclass
class _RecordedWorker:
    """A worker context whose transport records (what a KVStore needs: settings, transport, rank)."""

    settings: Settings
    transport: RecordingTransport
    rank: int


@pytest.mark.parametrize(("workers", "servers"), [(1, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("shape", [(), (7,), (40, 3)])
def test_ps_push_and_pull_send_their_plan(workers: int, servers: int, shape: tuple[int, ...]) -> None:
    def fn(ctx: Context) -> list[tuple[int, int, int]]:
        rec = RecordingTransport(ctx.transport)
        kv = KVStore("bsp", context=_RecordedWorker(ctx.settings, rec, ctx.rank), chunk_bytes=64)
        kv.init("w", np.zeros(shape))
        rec.take()  # init is not part of the round
        kv.push("w", np.ones(shape)).wait(30)
        kv.pull("w")  # at clock 0 nobody waits
        sent = [(m.dst, m.nbytes, m.tag) for m in rec.take()]
        kv.close()
        return sent

    recorded = run_ranks(workers, fn, servers=servers, timeout=60)
    rows, cols = as_rows(shape)
    chunks = plan_chunks("w", shape, 8, servers, chunk_bytes=64)
    plan = ps_round_plan(chunks, cols * 8, num_workers=workers, num_servers=servers)
    plan.validate()
    for rank, sent in enumerate(recorded):
        assert [(d, b) for d, b, _ in sent] == [(m.dst, m.nbytes) for m in plan.sends(rank)], f"worker {rank}"
    assert rows == sum(c.num_rows for c in chunks)


@pytest.mark.parametrize(("n", "topology"), [(2, "ring"), (4, "ring"), (5, "exponential"), (4, "complete")])
def test_gossip_round_sends_its_plan(n: int, topology: str) -> None:
    w, _ = resolve_mixing(topology, n)

    def fn(ctx: Context) -> list[tuple[int, int, int]]:
        rec = RecordingTransport(ctx.transport)
        ex = SocketExchange(rec, neighbors=neighbors(w, ctx.rank), next_tag=ctx.next_collective_tag, timeout=30)
        ex.post([np.full(10, float(ctx.rank), np.float32), np.zeros(3)])
        ex.wait()
        ex.close()
        return [(m.dst, m.nbytes, m.tag) for m in rec.take()]

    _assert_sent_the_plan(run_ranks(n, fn, timeout=60), gossip_plan(w, 10 * 4 + 3 * 8))


# -- shared memory: no message, but the counters follow the plan ---------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("count", [10, 3000, 20_000])  # one phase; several blocks of the 16 KiB capacity
def test_shared_memory_allreduce_signals_and_waits_as_planned(n: int, count: int) -> None:
    """Through shared memory nothing is sent (the recording transport stays empty); the segment's counters
    take exactly the plan's signal and wait steps, and the result is the sum."""
    capacity, small = 16 << 10, 1024

    def rank_fn(ctx: Context) -> tuple[list[tuple[str, int]], int, tuple[int, int, int]]:
        rec = RecordingTransport(ctx.transport)
        group = ShmGroup.create(
            rec,
            ranks=list(range(n)),
            run_id="plans",
            timeout=30,
            tag=ctx.next_collective_tag(),
            capacity=capacity,
            small_bytes=small,
        )
        try:
            rec.take()  # the segment's creation is not the collective
            steps: list[tuple[str, int]] = []
            seg = group.segment
            signal, wait_all = seg.signal, seg.wait_all

            def spy_signal(value: int) -> None:
                steps.append(("signal", value))
                signal(value)

            def spy_wait(value: int, deadline: float) -> None:
                steps.append(("wait", value))
                wait_all(value, deadline)

            seg.signal, seg.wait_all = spy_signal, spy_wait  # type: ignore[method-assign]
            x = np.arange(count, dtype=np.float32) + ctx.rank
            group.allreduce_(x)
            assert np.array_equal(x, n * np.arange(count, dtype=np.float32) + n * (n - 1) / 2)
            block = group._block_elems(np.dtype(np.float32), parts=n)
            return steps, len(rec.take()), (block, 16, group.small_bytes)
        finally:
            group.close()

    results = run_ranks(n, rank_fn, timeout=60)
    shm = results[0][2]
    plan = allreduce_plan("shm", n, count, 4, shm=shm)
    plan.validate()
    assert plan.messages() == []
    for rank, (steps, sent, _) in enumerate(results):
        assert sent == 0
        planned = [(a.kind, a.tag) for a in plan.ranks[rank] if a.kind in ("signal", "wait")]
        base = steps[0][1] - 1  # counters continue across calls; the plan counts from the call's start
        assert [(kind, value - base) for kind, value in steps] == planned, f"rank {rank}"
