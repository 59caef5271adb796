"""reduce, gather, scatter and all-to-all (:mod:`paratrain.collectives.personalized_calls`) against their
single-process references: exact on integers and on every block they move, on 1-5 ranks, in-process and over
sockets, numpy and torch, blocking and async, uneven blocks; a float reduce to rank 0 in the tree's order (the
tree allreduce's); every rank's plan sent exactly (recording transport); the same error on every rank when the
calls differ or one rank's arguments are bad; a dead peer an error, not a hang."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from paratrain.collectives.api import Collectives
from paratrain.collectives.lower_personalized import alltoall_plan, gather_plan, reduce_to_plan, scatter_plan
from paratrain.errors import CollectiveMismatchError, PeerLostError
from paratrain.plan import Plan
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.transport.recording import RecordingTransport

WORLDS = [1, 2, 3, 4, 5]


def _rows(rank: int, n: int) -> list[int]:
    """Rank ``rank``'s uneven split of its all-to-all data: rows for each destination, some of them 0."""
    return [(rank * 3 + q * 2) % 4 for q in range(n)]


def _data(rank: int, rows: int, trailing: int = 3) -> np.ndarray:
    return (np.arange(rows * trailing, dtype=np.int64).reshape(rows, trailing) + 1000 * rank) * (rank + 1)


@pytest.mark.parametrize(("n", "transport"), [(n, "inproc") for n in WORLDS] + [(1, "zmq"), (3, "zmq")])
def test_every_operation_equals_its_reference(n: int, transport: str) -> None:
    root = n - 1
    counts = [q + 1 for q in range(n)]  # the root's uneven scatter

    def rank_fn(ctx: Context) -> dict[str, Any]:
        r = ctx.rank
        mine = _data(r, r + 1)
        split = _rows(r, n)
        return {
            "reduce": ctx.reduce(mine[:1].copy(), root=root),
            "max": ctx.reduce(np.array([r, -r]), root=0, op="max"),
            "gather": ctx.gather(mine, root=root),
            "scatter": ctx.scatter(
                _data(9, sum(counts)) if r == root else np.empty((0, 3), np.int64), root, counts=counts
            ),
            "even": ctx.scatter(np.arange(2 * n + 1) if r == 0 else np.empty(0, np.int64)),
            "alltoall": ctx.alltoall(_data(r, sum(split)), counts=split),
        }

    got = run_ranks(n, rank_fn, transport=transport, timeout=60)
    blocks = [_data(r, r + 1) for r in range(n)]
    scattered = np.split(_data(9, sum(counts)), np.cumsum(counts)[:-1])
    even = np.array_split(np.arange(2 * n + 1), n)
    for r, out in enumerate(got):
        if r == root:
            np.testing.assert_array_equal(out["reduce"], sum(b[:1] for b in blocks))
            np.testing.assert_array_equal(out["gather"], np.concatenate(blocks))
        else:
            assert out["reduce"] is None and out["gather"] is None
        assert (out["max"] is None) == (r != 0)
        if r == 0:
            np.testing.assert_array_equal(out["max"], [n - 1, 0])
        np.testing.assert_array_equal(out["scatter"], scattered[r])
        np.testing.assert_array_equal(out["even"], even[r])
        # what each rank q sent to r: part r of q's split, in rank order
        parts = [np.split(_data(q, sum(_rows(q, n))), np.cumsum(_rows(q, n))[:-1])[r] for q in range(n)]
        np.testing.assert_array_equal(out["alltoall"], np.concatenate(parts))


@pytest.mark.parametrize("transport", ["inproc", "zmq"])  # (zmq: one host, so through the shared-memory segment)
def test_float_reduce_to_rank_0_sums_in_the_trees_order_and_torch_stays_torch(transport: str) -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal((5, 33)).astype(np.float32)

    def rank_fn(ctx: Context) -> tuple[Any, Any, Any, Any]:
        mine = torch.from_numpy(x[ctx.rank].copy())
        reduced = ctx.reduce(mine, root=0)
        assert (ctx.collectives._shm is not None) == (transport == "zmq")
        tree = ctx.allreduce(x[ctx.rank].copy(), algorithm="tree")  # rank 0 sums in the same binomial order
        mean = ctx.reduce_async(mine, root=0, op="mean").wait()
        pieces = ctx.alltoall_async(torch.arange(10) + 100 * ctx.rank).wait()
        return reduced, tree, mean, pieces

    got = run_ranks(5, rank_fn, transport=transport, timeout=60)
    reduced, tree, mean, _ = got[0]
    assert isinstance(reduced, torch.Tensor) and isinstance(mean, torch.Tensor)
    np.testing.assert_array_equal(reduced.numpy(), tree)
    np.testing.assert_allclose(mean.numpy(), x.mean(axis=0), rtol=1e-5)
    for r, (_, _, _, pieces) in enumerate(got):
        assert isinstance(pieces, torch.Tensor)
        assert pieces.tolist() == [v + 100 * q for q in range(5) for v in np.array_split(np.arange(10), 5)[r]]


def test_async_gather_and_scatter_copy_their_input_at_once() -> None:
    def rank_fn(ctx: Context) -> tuple[Any, Any]:
        x = np.full(2, ctx.rank)
        gathered = ctx.gather_async(x, root=1)
        scattered = ctx.scatter_async(np.arange(4) if ctx.rank == 1 else np.empty(0, np.int64), root=1)
        x[:] = -1  # after the call: the copy went
        return gathered.wait(), scattered.wait()

    got = run_ranks(2, rank_fn, timeout=60)
    assert got[0][0] is None and got[1][0].tolist() == [0, 0, 1, 1]
    assert [s.tolist() for _, s in got] == [[0, 1], [2, 3]]


Call = Callable[[Collectives, int], Any]
N = 4
SPLITS = [_rows(r, N) for r in range(N)]


def _recorded(call: Call) -> list[list[tuple[int, int]]]:
    def rank_fn(ctx: Context) -> list[tuple[int, int]]:
        rec = RecordingTransport(ctx.workers)
        coll = Collectives(transport=rec, next_tag=ctx.next_collective_tag, timeout=30)
        try:
            call(coll, ctx.rank)
        finally:
            coll.close()
        return [(m.dst, m.nbytes) for m in rec.take()]

    return run_ranks(N, rank_fn, timeout=60)


def _bounds(rows: list[int], row: int) -> tuple[tuple[int, int], ...]:
    edges = np.cumsum([0, *rows]) * row
    return tuple((int(edges[q]), int(edges[q + 1])) for q in range(len(rows)))


@pytest.mark.parametrize(
    ("call", "plan"),
    [
        (lambda c, r: c.reduce(np.ones(7), root=2), reduce_to_plan(N, 7, 8, root=2)),
        (
            lambda c, r: c.gather(np.ones((r, 2), np.float32), root=1),
            gather_plan(N, _bounds([0, 1, 2, 3], 2), 4, root=1),
        ),
        (
            lambda c, r: c.scatter(np.ones((6, 2)) if r == 3 else np.empty((0, 2)), 3, counts=[0, 1, 2, 3]),
            scatter_plan(N, _bounds([0, 1, 2, 3], 2), 8, root=3),
        ),
        (
            lambda c, r: c.alltoall(np.ones(sum(SPLITS[r]), np.int32), counts=SPLITS[r]),
            alltoall_plan(
                N,
                [_bounds(SPLITS[q], 1) for q in range(N)],
                [_bounds([SPLITS[q][r] for q in range(N)], 1) for r in range(N)],
                itemsize=4,
            ),
        ),
    ],
    ids=["reduce", "gather", "scatter", "alltoall"],
)
def test_each_call_sends_exactly_its_plan(call: Call, plan: Plan) -> None:
    plan.validate()
    for rank, sent in enumerate(_recorded(call)):
        assert sent == [(m.dst, m.nbytes) for m in plan.sends(rank)], f"rank {rank}"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ctx: ctx.alltoall(np.zeros((4, 2 + (ctx.rank == 1)))), "alltoall needs equal trailing dimensions"),
        (lambda ctx: ctx.gather(np.zeros(2, np.float32 if ctx.rank else np.float64)), "float64"),
        (lambda ctx: ctx.scatter(np.zeros(3), root=ctx.rank), "root 0 but rank 1 has root 1"),
        (lambda ctx: ctx.reduce(np.zeros(2), op="max" if ctx.rank == 2 else "sum"), "op 'sum'"),
    ],
    ids=["alltoall-trailing", "gather-dtype", "scatter-root", "reduce-op"],
)
def test_calls_that_differ_raise_the_same_error_on_every_rank_and_ranks_stay_usable(
    call: Callable[[Context], Any], message: str
) -> None:
    def rank_fn(ctx: Context) -> str:
        with pytest.raises(CollectiveMismatchError) as info:
            call(ctx)
        assert ctx.alltoall(np.arange(3)).shape == (3,)  # still usable, tags in step
        return str(info.value)

    errors = run_ranks(3, rank_fn, timeout=60)
    assert len(set(errors)) == 1 and message in errors[0], errors[0]


def test_bad_counts_on_one_rank_fail_it_and_the_others_at_once() -> None:
    def rank_fn(ctx: Context) -> str:
        counts = [1, 1, 5] if ctx.rank == 1 else None
        try:
            ctx.alltoall(np.arange(3), counts=counts)
        except (ValueError, CollectiveMismatchError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "completed"

    messages = run_ranks(3, rank_fn, timeout=60)
    assert messages[1].startswith("ValueError: counts must be 3 non-negative ints adding up to 3"), messages[1]
    for message in (messages[0], messages[2]):
        assert message.startswith("CollectiveMismatchError: ") and "rank 1 rejected its own arguments" in message


@pytest.mark.parametrize("op", ["reduce", "gather", "scatter", "alltoall"])
def test_a_dead_rank_is_peer_lost_not_a_hang(op: str) -> None:
    def rank_fn(ctx: Context) -> str:
        if ctx.rank == 2:
            ctx.transport.abort()  # as if the process crashed before the collective
            return "dead"
        x = np.ones((6, 2))
        calls = {
            "reduce": lambda: ctx.reduce(x, root=1, timeout=20),
            "gather": lambda: ctx.gather(x, root=0, timeout=20),
            "scatter": lambda: ctx.scatter(x, root=0, timeout=20),
            "alltoall": lambda: ctx.alltoall(x, timeout=20),
        }
        try:
            calls[op]()
        except PeerLostError:
            return "peer lost"
        return "completed"

    assert run_ranks(3, rank_fn, timeout=30) == ["peer lost", "peer lost", "dead"]


def test_groups_have_them_too_with_roots_and_ranks_of_the_group() -> None:
    def rank_fn(ctx: Context) -> tuple[Any, Any]:
        group = ctx.split(lambda rank: rank % 2)  # {0, 2} and {1, 3}: member m of group k is rank 2m + k
        got = group.alltoall(np.array([10 * ctx.rank, 10 * ctx.rank + 1]))
        return got.tolist(), group.gather(np.array([ctx.rank]), root=1)

    got = run_ranks(4, rank_fn, timeout=60)
    assert [g for g, _ in got] == [[0, 20], [10, 30], [1, 21], [11, 31]]
    assert [None if x is None else x.tolist() for _, x in got] == [None, None, [0, 2], [1, 3]]
