"""Collective plans against exact tables and by symbolic execution; reduction ops against torch and numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paratrain.collectives.ops import OPS, Reducer, bf16_to_f32, f32_to_bf16
from paratrain.collectives.plans import (
    RingStep,
    TreeStep,
    binomial_tree_broadcast,
    binomial_tree_reduce,
    chain_broadcast,
    chunk_bounds,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)
from paratrain.collectives.ring import segment_bounds

WORLD_SIZES = list(range(1, 18))

# -- chunking ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 5, 6, 7, 100, 1009])
def test_chunk_bounds_cut_like_numpy_array_split(length: int, n: int) -> None:
    data = np.arange(length)
    assert [data[a:b].tolist() for a, b in chunk_bounds(length, n)] == [p.tolist() for p in np.array_split(data, n)]


def test_chunk_bounds_table() -> None:
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError):
        chunk_bounds(3, 0)


def test_segment_bounds_table() -> None:
    assert segment_bounds(0, 0, 4) == []
    assert segment_bounds(3, 11, 4) == [(3, 7), (7, 11)]
    assert segment_bounds(3, 12, 4) == [(3, 7), (7, 11), (11, 12)]


# -- ring plans -------------------------------------------------------------------------------------------------


def test_ring_reduce_scatter_table_n4() -> None:
    # (send_to, send_chunk, recv_from, recv_chunk); rank r ends owning chunk r.
    assert [list(map(tuple, ring_reduce_scatter(r, 4))) for r in range(4)] == [
        [(1, 3, 3, 2), (1, 2, 3, 1), (1, 1, 3, 0)],
        [(2, 0, 0, 3), (2, 3, 0, 2), (2, 2, 0, 1)],
        [(3, 1, 1, 0), (3, 0, 1, 3), (3, 3, 1, 2)],
        [(0, 2, 2, 1), (0, 1, 2, 0), (0, 0, 2, 3)],
    ]


def test_ring_allgather_table_n3() -> None:
    assert [list(map(tuple, ring_allgather(r, 3))) for r in range(3)] == [
        [(1, 0, 2, 2), (1, 2, 2, 1)],
        [(2, 1, 0, 0), (2, 0, 0, 2)],
        [(0, 2, 1, 1), (0, 1, 1, 0)],
    ]


def test_ring_allreduce_table_n2_and_trivial_n1() -> None:
    assert ring_allreduce(0, 2) == [RingStep(1, 1, 1, 0), RingStep(1, 0, 1, 1)]
    assert ring_allreduce(1, 2) == [RingStep(0, 0, 0, 1), RingStep(0, 1, 0, 0)]
    assert ring_allreduce(0, 1) == []


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_allreduce_by_symbolic_execution(n: int) -> None:
    # Each rank holds, per chunk, the set of ranks whose contribution it has summed. Execute the plans in
    # lock step, checking that every send is the receive its neighbour expects.
    held = [[{r} for _ in range(n)] for r in range(n)]
    plans = [ring_allreduce(r, n) for r in range(n)]
    assert all(len(p) == 2 * (n - 1) for p in plans)
    for s in range(2 * (n - 1)):
        messages = {}
        for r in range(n):
            step = plans[r][s]
            assert step.send_to == (r + 1) % n and step.recv_from == (r - 1) % n
            if s + 1 < len(plans[r]):
                assert plans[r][s + 1].send_chunk == step.recv_chunk  # forward what was just received
            messages[(r, step.send_to)] = (step.send_chunk, set(held[r][step.send_chunk]))
        for r in range(n):
            step = plans[r][s]
            chunk, contributions = messages[(step.recv_from, r)]
            assert chunk == step.recv_chunk
            if s < n - 1:  # reduce-scatter: combine, never counting a contribution twice
                assert not held[r][chunk] & contributions
                held[r][chunk] |= contributions
            else:  # allgather: overwrite with a complete chunk
                assert contributions == set(range(n))
                held[r][chunk] = contributions
        if s == n - 2:
            for r in range(n):
                assert held[r][r] == set(range(n)), "after reduce-scatter rank r must own chunk r"
    assert all(chunk == set(range(n)) for rank in held for chunk in rank)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_reduce_scatter_leaves_rank_r_with_chunk_r(n: int) -> None:
    held = [[{r} for _ in range(n)] for r in range(n)]
    for s in range(n - 1):
        sent = {r: set(held[r][ring_reduce_scatter(r, n)[s].send_chunk]) for r in range(n)}
        for r in range(n):
            step = ring_reduce_scatter(r, n)[s]
            held[r][step.recv_chunk] |= sent[step.recv_from]
    assert [held[r][r] for r in range(n)] == [set(range(n))] * n


def test_ring_plans_reject_bad_ranks() -> None:
    for bad in [(-1, 3), (3, 3), (0, 0)]:
        with pytest.raises(ValueError):
            ring_allreduce(*bad)


# -- tree plans -------------------------------------------------------------------------------------------------


def test_binomial_reduce_table_n5_root0() -> None:
    table = {r: [tuple(s) for s in binomial_tree_reduce(r, 5, 0)] for r in range(5)}
    assert table == {
        0: [(1, "recv"), (2, "recv"), (4, "recv")],
        1: [(0, "send")],
        2: [(3, "recv"), (0, "send")],
        3: [(2, "send")],
        4: [(0, "send")],
    }


def test_binomial_broadcast_table_n6_root3() -> None:
    # relative ranks v = (r - 3) mod 6: root 3 = v0 sends to v4 (r1), v2 (r5), v1 (r4); v2 sends to v3 (r0); ...
    table = {r: [tuple(s) for s in binomial_tree_broadcast(r, 6, 3)] for r in range(6)}
    assert table == {
        3: [(1, "send"), (5, "send"), (4, "send")],
        4: [(3, "recv")],
        5: [(3, "recv"), (0, "send")],
        0: [(5, "recv")],
        1: [(3, "recv"), (2, "send")],
        2: [(1, "recv")],
    }


def test_chain_broadcast_table() -> None:
    assert [list(map(tuple, chain_broadcast(r, 4, 1))) for r in range(4)] == [
        [(3, "recv")],
        [(2, "send")],
        [(1, "recv"), (3, "send")],
        [(2, "recv"), (0, "send")],
    ]
    assert chain_broadcast(0, 1) == []


def _run_tree(plans: list[list[TreeStep]], initial: list[set[int]], combine: bool) -> tuple[list[set[int]], int]:
    """Executes tree plans in synchronous rounds: a send happens when its peer's next step is the matching receive.

    Returns every rank's final state and the number of rounds; fails on a deadlock (no step possible).
    """
    n = len(plans)
    state = [set(s) for s in initial]
    pos = [0] * n
    rounds = 0
    while any(pos[r] < len(plans[r]) for r in range(n)):
        rounds += 1
        matches = []
        for r in range(n):
            if pos[r] < len(plans[r]) and plans[r][pos[r]].direction == "send":
                peer = plans[r][pos[r]].peer
                if pos[peer] < len(plans[peer]) and plans[peer][pos[peer]] == TreeStep(r, "recv"):
                    matches.append((r, peer))
        assert matches, f"deadlock at positions {pos}"
        snapshot = [set(s) for s in state]
        for r, peer in matches:
            state[peer] = (state[peer] | snapshot[r]) if combine else set(snapshot[r])
            pos[r] += 1
            pos[peer] += 1
    return state, rounds


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_binomial_reduce_gathers_everything_in_log_rounds_at_any_root(n: int) -> None:
    for root in range(n):
        plans = [binomial_tree_reduce(r, n, root) for r in range(n)]
        assert sum(s.direction == "send" for p in plans for s in p) == n - 1  # every non-root sends once
        assert [s.direction for s in plans[root]] == ["recv"] * len(plans[root])
        state, rounds = _run_tree(plans, [{r} for r in range(n)], combine=True)
        assert state[root] == set(range(n))
        assert rounds == math.ceil(math.log2(n))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_binomial_broadcast_reaches_everyone_in_log_rounds_from_any_root(n: int) -> None:
    for root in range(n):
        plans = [binomial_tree_broadcast(r, n, root) for r in range(n)]
        for r, plan in enumerate(plans):
            recvs = [s for s in plan if s.direction == "recv"]
            assert len(recvs) == (0 if r == root else 1)
            assert not recvs or plan[0] == recvs[0]  # receive before forwarding
        state, rounds = _run_tree(plans, [{0} if r == root else set() for r in range(n)], combine=False)
        assert state == [{0}] * n
        assert rounds == math.ceil(math.log2(n))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_broadcast_is_the_mirror_of_reduce(n: int) -> None:
    for r in range(n):
        reduce_edges = {(s.peer, "recv" if s.direction == "send" else "send") for s in binomial_tree_reduce(r, n, 0)}
        broadcast_edges = {(s.peer, s.direction) for s in binomial_tree_broadcast(r, n, 0)}
        assert reduce_edges == broadcast_edges


# -- reduction ops ----------------------------------------------------------------------------------------------


def test_reducer_refuses_undefined_ops() -> None:
    with pytest.raises(ValueError, match="sum, mean, max, min"):
        Reducer("prod", "float32")
    with pytest.raises(TypeError, match="bool"):
        Reducer("sum", "bool")
    with pytest.raises(TypeError, match="bool"):
        Reducer("mean", "bool")
    with pytest.raises(TypeError, match="complex"):
        Reducer("max", "complex64")
    assert OPS == ("sum", "mean", "max", "min")


def test_bool_max_is_or_and_min_is_and() -> None:
    a, b = np.array([True, True, False, False]), np.array([True, False, True, False])
    out = np.empty_like(a)
    Reducer("max", "bool").combine(a, b, out)
    assert out.tolist() == [True, True, True, False]
    Reducer("min", "bool").combine(a, b, out)
    assert out.tolist() == [True, False, False, False]


def test_integer_mean_floors() -> None:
    buf = np.array([7, -7, 6, 0], dtype=np.int32)
    Reducer("mean", "int32").finish(buf, 2)
    assert buf.tolist() == [3, -4, 3, 0]
    assert buf.dtype == np.int32


def test_float_mean_divides_once_and_other_ops_do_not() -> None:
    buf = np.array([3.0, 1.0], dtype=np.float32)
    Reducer("mean", "float32").finish(buf, 2)
    assert buf.tolist() == [1.5, 0.5]
    Reducer("sum", "float32").finish(buf, 2)
    assert buf.tolist() == [1.5, 0.5]


def test_float16_accumulates_in_float16() -> None:
    a = np.array([2048.0], dtype=np.float16)
    Reducer("sum", "float16").combine(a, np.array([1.0], dtype=np.float16), a)
    assert a.dtype == np.float16 and a[0] == 2048.0  # 2049 is not a float16: rounded to even


def test_bfloat16_conversions_match_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(10_000).astype(np.float32) * 1e3,
            np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]),
        ]
    ).astype(np.float32)
    ours = f32_to_bf16(values.copy())
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(bf16_to_f32(ours), torch.from_numpy(theirs.view(np.int16)).view(torch.bfloat16).float())
    nan = f32_to_bf16(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(bf16_to_f32(nan)).all()


@pytest.mark.parametrize("op", OPS)
def test_bfloat16_ops_match_torch(op: str) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(4096, generator=gen).to(torch.bfloat16) for _ in range(2))
    a_bits = a.view(torch.int16).numpy().view(np.uint16).copy()
    b_bits = b.view(torch.int16).numpy().view(np.uint16)
    reducer = Reducer(op, "bfloat16")
    reducer.combine(a_bits, b_bits, a_bits)
    reducer.finish(a_bits, 2)
    expected = {
        "sum": lambda: a + b,
        "mean": lambda: (a + b) / 2,
        "max": lambda: torch.maximum(a, b),
        "min": lambda: torch.minimum(a, b),
    }[op]()
    assert np.array_equal(a_bits, expected.view(torch.int16).numpy().view(np.uint16))
