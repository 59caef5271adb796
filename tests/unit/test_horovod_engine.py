"""The Horovod engine's rules on in-process ranks: requests matched by name whatever the order, fused allreduces
equal to unfused ones to the bit, mismatches named on every rank, join with neutral tensors, and the timeline's
phases for each tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain.horovod.controller import Engine, Request
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.timeline import Timeline

SUM, AVERAGE, MIN, MAX, PRODUCT, ADASUM = 1, 0, 3, 4, 5, 2


def _engine(ctx: Context, fusion: int = 1 << 20, timeline: Timeline | None = None) -> Engine:
    group = ctx.new_group(range(ctx.world_size))
    assert group is not None
    return Engine(group, timeline=timeline, fusion_bytes=fusion, error=lambda e: RuntimeError(str(e)))


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(k + 1, generator=g, dtype=torch.float32) for k in range(12)]


def _reduce_all(engine: Engine, rank: int, order: list[int], op: int) -> list[torch.Tensor]:
    """Submits the 12 tensors in ``order`` while holding the engine's lock, so that its first cycle sees them
    all (and fuses them, when fusion is on); returns the results in tensor order."""
    tensors = _tensors(rank)
    with engine._cond:  # the engine thread cannot take the queue until every request is in
        futures = {k: engine.submit(Request(f"t{k}", "allreduce", tensors[k], op)) for k in order}
    return [futures[k].result(timeout=30) for k in range(12)]


def test_fused_allreduces_equal_unfused_ones_and_ranks_may_ask_in_any_order() -> None:
    def fn(ctx: Context) -> tuple[list[list[torch.Tensor]], list[dict[str, int]]]:
        order = list(range(12)) if ctx.rank == 0 else list(reversed(range(12)))
        out, stats = [], []
        for fusion in (1 << 20, 0):
            engine = _engine(ctx, fusion)
            out.append(_reduce_all(engine, ctx.rank, order, SUM) + _reduce_all(engine, ctx.rank, order, AVERAGE))
            engine.close(10)
            stats.append(dict(engine.stats))
        return out, stats

    results = run_ranks(3, fn)
    fused, unfused = results[0][0]
    for k in range(12):
        want = sum(_tensors(r)[k] for r in range(3))  # the rank-order sum, as the collectives add
        assert torch.equal(fused[k], unfused[k]) and torch.allclose(fused[k], want, atol=1e-6)
        assert torch.equal(fused[12 + k], unfused[12 + k])
        assert torch.allclose(fused[12 + k], want / 3, atol=1e-6)
    for out, _ in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], fused, strict=True))
    fused_stats, unfused_stats = results[0][1]
    # rank 0 submitted t0..t11, rank 1 t11..t0 before either engine ran a cycle: one cycle finds all 12 ready
    assert fused_stats["fused_tensors"] == 24 and fused_stats["fused_messages"] == 2, fused_stats
    assert unfused_stats["fused_messages"] == 0


def test_a_mismatch_fails_that_request_on_every_rank_naming_the_ranks_and_the_rest_still_run() -> None:
    def fn(ctx: Context) -> list[str]:
        engine = _engine(ctx)
        shape = (2,) if ctx.rank == 0 else (3,)
        bad = engine.submit(Request("w", "allreduce", torch.ones(shape), SUM))
        dtype = engine.submit(
            Request("d", "allreduce", torch.ones(2, dtype=torch.float64 if ctx.rank else torch.float32), SUM)
        )
        op = engine.submit(Request("o", "allreduce", torch.ones(2), MIN if ctx.rank else MAX))
        # a device tensor on one rank only (the "meta" device stands for CUDA here: no data moves)
        device = engine.submit(Request("v", "allreduce", torch.ones(2, device="meta" if ctx.rank else "cpu"), SUM))
        good = engine.submit(Request("g", "allreduce", torch.ones(2), SUM))
        messages = []
        for f in (bad, dtype, op, device):
            try:
                f.result(timeout=30)
                messages.append("no error")
            except RuntimeError as exc:
                messages.append(str(exc))
        assert torch.equal(good.result(timeout=30), torch.full((2,), 2.0))
        try:
            engine.submit(Request("g2", "allreduce", torch.ones(1), SUM))
            engine.submit(Request("g2", "allreduce", torch.ones(1), SUM))
            messages.append("duplicate accepted")
        except ValueError as exc:
            messages.append(str(exc))
        engine.close(10)
        return messages

    for messages in run_ranks(2, fn):
        assert messages[0] == "Mismatched allreduce tensor shapes: rank 0 sent (2,), but rank 1 sent (3,)"
        assert messages[1] == "Mismatched allreduce dtype: rank 0 sent float32, but rank 1 sent float64"
        assert messages[2] == "Mismatched allreduce reduction op: rank 0 sent Max, but rank 1 sent Min"
        assert messages[3] == "Mismatched allreduce device type: rank 0 sent cpu, but rank 1 sent meta"
        assert "same name" in messages[4] and "'g2'" in messages[4]


def test_join_neutral_tensors_and_the_last_rank_to_join() -> None:
    """Rank r runs 3 - r steps (Sum, Average, Min, Max and Adasum each step), then joins: a step's result is the
    op over the ranks still running (Average divided by the whole job, as Horovod's), and every join returns
    rank 0, the last to join."""

    def fn(ctx: Context) -> tuple[list[list[torch.Tensor]], int, str]:
        engine = _engine(ctx)
        steps = []
        for step in range(3 - ctx.rank):
            x = torch.tensor([1.0 + ctx.rank, -2.0 * (ctx.rank + 1), 0.5 + step])
            futures = [engine.submit(Request(f"s{step}.{op}", "allreduce", x, op)) for op in (SUM, AVERAGE, MIN, MAX)]
            futures.append(engine.submit(Request(f"s{step}.adasum", "allreduce", torch.eye(3)[ctx.rank], ADASUM)))
            steps.append([f.result(timeout=30) for f in futures])
        problem = ""
        if ctx.rank == 0:  # ranks 1 and 2 have joined by now: no allgather
            gather = engine.submit(Request("g", "allgather", torch.ones(1), run=lambda g: g.allgather(torch.ones(1))))
            try:
                gather.result(timeout=30)
            except RuntimeError as exc:
                problem = str(exc)
        last = engine.submit(Request("join", "join")).result(timeout=30)
        engine.close(10)
        return steps, last, problem

    results = run_ranks(3, fn)
    for step in range(3):
        running = range(3 - step)  # the ranks that have not joined at this step
        xs = [torch.tensor([1.0 + r, -2.0 * (r + 1), 0.5 + step]) for r in running]
        want = [
            sum(xs),
            sum(xs) / 3,
            torch.stack(xs).min(0).values,
            torch.stack(xs).max(0).values,
            torch.tensor([1.0 if r in running else 0.0 for r in range(3)]),  # orthogonal: their sum
        ]
        for r in running:
            for got, expected in zip(results[r][0][step], want, strict=True):
                assert torch.allclose(got, expected), (step, r, got, expected)
    assert [last for _, last, _ in results] == [0, 0, 0]
    assert results[0][2] == "Allgather is not supported with Join at this time (only allreduce is)"


def test_the_timeline_shows_each_tensors_negotiation_queue_and_communication(tmp_path: Path) -> None:
    def fn(ctx: Context) -> None:
        timeline = Timeline(tmp_path / f"t{ctx.rank}.json", rank=ctx.rank)
        engine = _engine(ctx, timeline=timeline)
        _reduce_all(engine, ctx.rank, list(range(12)), SUM)
        one = torch.full((2,), float(ctx.rank))
        request = Request("b", "broadcast", one, root=1, run=lambda g: g.broadcast(one, 1))
        assert torch.equal(engine.submit(request).result(timeout=30), torch.ones(2))
        engine.close(10)
        timeline.close()

    run_ranks(2, fn)
    for rank in range(2):
        events: list[dict[str, Any]] = json.loads((tmp_path / f"t{rank}.json").read_text())
        rows = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        by_row: dict[str, list[str]] = {}
        for e in events:
            if e["ph"] in "Xi" and e["pid"] in rows:
                by_row.setdefault(rows[e["pid"]], []).append(e["name"])
        assert by_row["t3"][:1] == ["NEGOTIATE_ALLREDUCE"], by_row["t3"]
        assert {"0", "1"} <= set(by_row["t3"])  # when each rank had asked for it
        assert {"ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "COMMUNICATE", "MEMCPY_OUT_FUSION_BUFFER"} <= set(
            by_row["t3"]
        )
        assert {"NEGOTIATE_BROADCAST", "BROADCAST", "COMMUNICATE"} <= set(by_row["b"])
        spans = {e["name"]: e for e in events if e["ph"] == "X" and rows.get(e["pid"]) == "t3"}
        top, comm = spans["ALLREDUCE"], spans["COMMUNICATE"]
        assert top["ts"] <= comm["ts"] and comm["ts"] + comm["dur"] <= top["ts"] + top["dur"] + 1
        assert comm["args"]["bytes"] == 4 * sum(k + 1 for k in range(12))  # the fusion buffer


def test_a_lost_peer_fails_pending_and_later_requests_instead_of_hanging() -> None:
    def fn(ctx: Context) -> str:
        engine = _engine(ctx)
        assert torch.equal(
            engine.submit(Request("a", "allreduce", torch.ones(2), SUM)).result(30), torch.full((2,), 2.0)
        )
        if ctx.rank == 1:
            ctx.abort()  # this rank dies
            return "gone"
        try:
            engine.submit(Request("b", "allreduce", torch.ones(2), SUM)).result(30)
            return "no error"
        except RuntimeError as exc:
            first = str(exc)
        try:
            engine.submit(Request("c", "allreduce", torch.ones(2), SUM))
            return "accepted after the failure"
        except RuntimeError as exc:
            return f"{first} | {exc}"

    first, later = run_ranks(2, fn)[0].split(" | ")
    assert "rank 1" in first and "crashed" in first and later == first, (first, later)


def test_requests_that_never_match_fail_every_rank_after_the_stall_bound_naming_them() -> None:
    # Rank 0 asks for "a", rank 1 for "b" (ranks whose code differs): neither can ever be ready. Once a request
    # has waited past the bound, every rank fails in the same cycle, with the same message; later calls fail too.
    def fn(ctx: Context) -> str:
        group = ctx.new_group(range(ctx.world_size))
        assert group is not None
        engine = Engine(group, timeline=None, error=lambda e: RuntimeError(str(e)), stall_s=0.3)
        name = "a" if ctx.rank == 0 else "b"
        try:
            engine.submit(Request(name, "allreduce", torch.ones(2), SUM)).result(30)
            return "no error"
        except RuntimeError as exc:
            message = str(exc)
        with pytest.raises(RuntimeError):
            engine.submit(Request("c", "allreduce", torch.ones(2), SUM))
        return message

    messages = run_ranks(2, fn)
    assert messages[0] == messages[1], messages
    assert "waited more than 0s (PARATRAIN_TIMEOUT)" in messages[0]
    assert "a (asked for by ranks [0], not by [1]); b (asked for by ranks [1], not by [0])" in messages[0]


def test_the_elastic_sampler_deals_out_what_is_left_of_the_epoch() -> None:
    from paratrain.horovod.elastic import ElasticSampler

    samplers = [ElasticSampler(range(100), seed=3, world=(r, 3)) for r in range(3)]
    dealt = [list(s) for s in samplers]
    assert (
        sorted(i for part in dealt for i in part)[:100] == list(range(100))
        or len({*dealt[0], *dealt[1], *dealt[2]}) == 100
    )
    for s in samplers:  # each rank processes its first two batches of 5
        s.record_batch(0, 5)
        s.record_batch(1, 5)
    done = set().union(*(s.processed_indices for s in samplers))
    assert len(done) == 30
    for s in samplers:  # the job re-forms as 2: the rest of the epoch, once each, in the same order everywhere
        s.load_state_dict({"epoch": 0, "processed_indices": sorted(done)})
    survivors = [samplers[0], samplers[2]]
    for r, s in enumerate(survivors):
        s.reset(world=(r, 2))
    rest = [i for s in survivors for i in s]
    assert len(rest) == 70 and set(rest) == set(range(100)) - done
    survivors[0].set_epoch(1)  # a new epoch: everything again, in another order
    assert survivors[0].processed_indices == set() and list(survivors[0]) != dealt[0]
