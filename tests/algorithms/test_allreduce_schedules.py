"""Halving-doubling, the 2-D torus and the double binary tree: their step tables, their plans executed
symbolically, the runtime against one-process references (inproc and sockets), the sends against the plans
(recording transport), the simulator's costs against the textbook. (A mismatch and a dead peer: with every
algorithm in test_collectives.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from paratrain import Context
from paratrain.collectives.algorithms import AllreduceAlgorithm, planned_allreduce
from paratrain.collectives.api import Collectives
from paratrain.collectives.lower_allreduce import allreduce_plan
from paratrain.collectives.plans_allreduce import double_binary_tree, halving_doubling, in_order_tree, torus_shape
from paratrain.plan import simulate
from paratrain.testing import count_contributions, run_ranks
from paratrain.transport.recording import RecordingTransport

pytestmark = pytest.mark.timeout(60)

NEW = ["halving_doubling", "torus", "double_tree"]

# -- step tables --------------------------------------------------------------------------------------------------


def test_halving_doubling_tables() -> None:
    """4 ranks: halves with the rank 2 away, then quarters with the next; 6 ranks: 0 and 2 sit out, their odd
    partners take the active places 0 and 1 of four."""
    assert [tuple(s) for s in halving_doubling(3, 4).halving] == [(1, (0, 2), (2, 4)), (2, (2, 3), (3, 4))]
    assert [tuple(s) for s in halving_doubling(3, 4).doubling] == [(2, (3, 4), (2, 3)), (1, (2, 4), (0, 2))]
    assert [halving_doubling(r, 6).fold for r in range(6)] == [("send", 1), ("recv", 0), ("send", 3), ("recv", 2),
                                                               None, None]  # fmt: skip
    assert [s.peer for s in halving_doubling(1, 6).halving] == [4, 3]  # active 0: partners active 2 (rank 4), 1
    assert [s.peer for s in halving_doubling(5, 6).halving] == [3, 4]  # active 3: partners active 1, 2
    assert halving_doubling(0, 1) == (1, None, (), ())


@pytest.mark.parametrize("n", range(1, 18))
def test_halving_leaves_every_active_rank_its_own_part(n: int) -> None:
    owned = sorted(h.halving[-1].recv for h in (halving_doubling(r, n) for r in range(n)) if h.halving)
    p = 1 << (n.bit_length() - 1)
    assert owned == ([(v, v + 1) for v in range(p)] if n > 1 else [])


def test_torus_shapes() -> None:
    assert [torus_shape(n) for n in (1, 2, 4, 6, 8, 9, 12, 13, 16)] == [
        (1, 1), (1, 2), (2, 2), (2, 3), (2, 4), (3, 3), (3, 4), (1, 13), (4, 4)
    ]  # fmt: skip


@pytest.mark.parametrize("n", range(1, 18))
def test_both_trees_span_the_ranks_and_even_worlds_have_every_rank_inner_once(n: int) -> None:
    for t in range(2):
        places = [double_binary_tree(r, n)[t] for r in range(n)]
        assert sum(p.parent is None for p in places) == 1
        for r, place in enumerate(places):
            assert len(place.children) <= 2
            assert all(places[c].parent == r for c in place.children)
            seen, at = set(), r  # the path to the root ends (no cycle)
            while at is not None:
                assert at not in seen
                seen.add(at)
                at = places[at].parent
        assert max(len(_path(places, r)) for r in range(n)) <= n.bit_length()
    if n % 2 == 0 and n > 1:
        inner = [sum(bool(double_binary_tree(r, n)[t].children) for t in range(2)) for r in range(n)]
        assert inner == [1] * n
    assert in_order_tree(3, 6) == (None, (1, 5))


def _path(places: list[Any], r: int) -> list[int]:
    path = [r]
    while places[path[-1]].parent is not None:
        path.append(places[path[-1]].parent)
    return path


# -- the plans, executed symbolically -----------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", NEW)
@pytest.mark.parametrize("n", range(2, 13))  # (one rank never reaches an algorithm: the API copies)
@pytest.mark.parametrize("aliased", [False, True])
def test_every_item_sums_every_rank_once(algorithm: str, n: int, aliased: bool) -> None:
    for count in (0, 1, n - 1, 2 * n + 3, 40):
        plan = allreduce_plan(algorithm, n, count, 8, aliased=aliased, segment_bytes=24, agreement=False)
        plan.validate()
        for r, dst in enumerate(count_contributions(plan, count, aliased=aliased)):
            assert np.array_equal(dst, np.ones((count, n))), (count, r, dst)


def test_the_torus_of_a_prime_world_is_the_ring() -> None:
    assert allreduce_plan("torus", 5, 100, 4).ranks == allreduce_plan("ring", 5, 100, 4).ranks


# -- the simulator: the textbook costs from the plans -----------------------------------------------------------


def test_simulated_costs_are_the_textbooks() -> None:
    """alpha-beta on one link per node, one segment per message: halving-doubling and the 2x2 torus take
    2 log2 4 = 4 latencies and move 2 (N - 1)/N of the array, the ring 2 (N - 1) = 6 latencies and as much; a
    non-power of two pays the fold (two whole arrays) on top; the double tree of 2 is a reduce-scatter and an
    allgather between the two."""
    a, b, nbytes = 1e-3, 1e-8, 1 << 16

    def cost(algorithm: str, n: int) -> float:
        return simulate(allreduce_plan(algorithm, n, nbytes, 1, agreement=False), alpha=a, beta=b).time

    assert cost("halving_doubling", 4) == pytest.approx(4 * a + 1.5 * nbytes * b)
    assert cost("torus", 4) == pytest.approx(4 * a + 1.5 * nbytes * b)
    assert cost("ring", 4) == pytest.approx(6 * a + 1.5 * nbytes * b)
    assert cost("halving_doubling", 8) == pytest.approx(6 * a + 1.75 * nbytes * b)
    assert cost("halving_doubling", 3) == pytest.approx(4 * a + 3 * nbytes * b)
    assert cost("double_tree", 2) == pytest.approx(2 * a + nbytes * b)


# -- the runtime --------------------------------------------------------------------------------------------------


def _input(rank: int, seed: int, size: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, seed])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, size=size).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


def _register(ctx: Context) -> None:
    for name in NEW:  # many pipelined segments even for small arrays
        ctx.collectives.allreduce_algorithms[f"{name}-64B"] = AllreduceAlgorithm(
            planned_allreduce(name, segment_bytes=64)
        )


CASES = [("int64", "sum"), ("int64", "mean"), ("float32", "mean"), ("float64", "max")]


@pytest.mark.parametrize("algorithm", NEW)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_the_runtime_equals_the_one_process_reference(algorithm: str, n: int) -> None:
    sizes = sorted({0, 1, n + 1, 1009})
    cases = [(d, op, size, name) for d, op in CASES for size in sizes for name in (algorithm, f"{algorithm}-64B")]

    def rank_fn(ctx: Context) -> list[np.ndarray]:
        _register(ctx)
        out = []
        for seed, (dtype, op, size, name) in enumerate(cases):
            x = _input(ctx.rank, seed, size, dtype)
            out.append(ctx.allreduce(x, op=op, algorithm=name))
            y = x.copy()
            assert ctx.allreduce_(y, op=op, algorithm=name) is y and np.array_equal(y, out[-1]), "in place"
        return out

    results = run_ranks(n, rank_fn, timeout=50)
    for seed, (dtype, op, size, _) in enumerate(cases):
        inputs = np.stack([_input(r, seed, size, dtype) for r in range(n)])
        for r in range(n):
            assert np.array_equal(results[r][seed], results[0][seed]), "every rank has the same bits"
        got = results[0][seed]
        if op == "max":
            assert np.array_equal(got, inputs.max(axis=0))
        elif dtype == "int64":
            total = inputs.sum(axis=0)
            assert np.array_equal(got, total if op == "sum" else np.floor_divide(total, n))
        else:
            want = inputs.astype(np.float64).sum(axis=0) / n
            np.testing.assert_allclose(got, want, rtol=4e-6 * n, atol=4e-6 * n)


def test_the_double_tree_sums_in_its_documented_order() -> None:
    """float32, 6 ranks: each half's items are this rank's + its first child's subtree + its second's, up its
    tree, computed here from the step table alone: the runtime's bits."""
    n, count = 6, 2001
    inputs = [_input(r, 3, count, "float32") for r in range(n)]
    results = run_ranks(n, lambda ctx: ctx.allreduce(inputs[ctx.rank], algorithm="double_tree"), timeout=30)
    half = (count + 1) // 2
    want = np.empty(count, dtype=np.float32)
    for t, (a, z) in enumerate(((0, half), (half, count))):
        places = [double_binary_tree(r, n)[t] for r in range(n)]

        def subtree(r: int, a: int = a, z: int = z, places: list[Any] = places) -> np.ndarray:
            acc = inputs[r][a:z]
            for c in places[r].children:
                acc = acc + subtree(c)
            return acc

        want[a:z] = subtree(next(r for r in range(n) if places[r].parent is None))
    for got in results:
        assert np.array_equal(got, want)


def test_over_real_sockets() -> None:
    sizes = [5, 300_001]  # the second in several segments of the default size

    def rank_fn(ctx: Context) -> list[np.ndarray]:
        return [ctx.allreduce(_input(ctx.rank, s, s, "int64"), algorithm=a) for a in NEW for s in sizes]

    results = run_ranks(4, rank_fn, transport="zmq", timeout=60)
    wants = [sum(_input(r, s, s, "int64") for r in range(4)) for _ in NEW for s in sizes]
    for got in results:
        for g, w in zip(got, wants, strict=True):
            assert np.array_equal(g, w)


@pytest.mark.parametrize("algorithm", NEW)
def test_each_sends_exactly_its_plan(algorithm: str) -> None:
    def rank_fn(ctx: Context) -> list[list[tuple[int, int]]]:
        sent = []
        for name, count in ((algorithm, 1000), (f"{algorithm}-64B", 101)):
            rec = RecordingTransport(ctx.workers)
            coll = Collectives(transport=rec, next_tag=ctx.next_collective_tag, timeout=30)
            coll.allreduce_algorithms[f"{algorithm}-64B"] = AllreduceAlgorithm(
                planned_allreduce(algorithm, segment_bytes=64)
            )
            try:
                coll.allreduce(np.full(count, ctx.rank, np.float32), algorithm=name)
            finally:
                coll.close()
            sent.append([(m.dst, m.nbytes) for m in rec.take()])
        return sent

    for n in (2, 3, 4, 5):
        recorded = run_ranks(n, rank_fn, timeout=50)
        for k, (count, segment) in enumerate(((1000, None), (101, 64))):
            plan = allreduce_plan(algorithm, n, count, 4, segment_bytes=segment)
            plan.validate()
            for r in range(n):
                assert recorded[r][k] == [(m.dst, m.nbytes) for m in plan.sends(r)], (n, k, r)
