"""Collectives over in-process ranks (and a few over real sockets), checked against numpy on one process.

Every rank builds its input from ``(rank, seed)``; the test recomputes all inputs and the expected result with
numpy. Integers must match exactly, floats within a tolerance that grows with the world size (the reduction
order differs from numpy's), and every rank must hold the same bits.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import paratrain as pt
from paratrain import Context
from paratrain.collectives.api import AllreduceAlgorithm
from paratrain.collectives.ring import chain_broadcast_run, ring_allreduce_run
from paratrain.errors import CollectiveMismatchError, CommTimeoutError, DeviceTimeoutError, PeerLostError
from paratrain.testing import run_ranks
from paratrain.transport.inproc import InprocFabric

pytestmark = pytest.mark.timeout(60)

OPS = ["sum", "mean", "max", "min"]
NUMPY_DTYPES = ["float32", "float64", "float16", "int32", "int64"]
ALGORITHMS = ["ring", "tree", "direct", "auto"]
#: a ring with tiny segments, registered by the tests: many pipelined segments even for small arrays
SMALL_RING = "ring-64B"


def sizes_for(n: int) -> list[int]:
    return sorted({0, 1, max(n - 1, 0), n + 1, 1009})


def make_input(rank: int, seed: int, size: int | tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, seed])
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-1000, 1000, size=size).astype(dtype)
    return rng.standard_normal(size).astype(dtype)


def expected(inputs: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(inputs)
    if op == "max":
        return stack.max(axis=0)
    if op == "min":
        return stack.min(axis=0)
    if stack.dtype.kind in "iu":
        total = stack.astype(np.int64).sum(axis=0)
        return total if op == "sum" else np.floor_divide(total, len(inputs))
    total = stack.astype(np.float64).sum(axis=0)
    return total if op == "sum" else total / len(inputs)


def tolerance(dtype: str, n: int) -> dict[str, float]:
    eps = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-6, "float64": 1e-14}[dtype]
    # partial sums of standard normals stay within a few units; allow a few roundings per combining step
    return {"rtol": 4 * eps * n, "atol": 4 * eps * n}


def assert_reduced(results: list[np.ndarray], inputs: list[np.ndarray], op: str, dtype: str) -> None:
    n = len(inputs)
    want = expected(inputs, op)
    for r, got in enumerate(results):
        assert got.shape == inputs[0].shape, f"rank {r}"
        assert got.dtype == np.dtype(dtype), f"rank {r}"
        assert np.array_equal(got, results[0], equal_nan=True), f"rank {r} differs from rank 0"
    got = results[0]
    if np.dtype(dtype).kind in "iu" or op in ("max", "min"):
        assert np.array_equal(got, want.astype(dtype)), (op, dtype, got, want)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want, **tolerance(dtype, n))


def register_small_segments(ctx: Context) -> None:
    ctx.collectives.allreduce_algorithms[SMALL_RING] = AllreduceAlgorithm(
        functools.partial(ring_allreduce_run, segment_bytes=64)
    )
    ctx.collectives.broadcast_algorithms["chain-64B"] = functools.partial(chain_broadcast_run, segment_bytes=64)


# -- allreduce: the correctness matrix -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("algorithm", [*ALGORITHMS, SMALL_RING])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allreduce_matrix(n: int, algorithm: str, dtype: str) -> None:
    cases = [(op, size) for op in OPS for size in sizes_for(n)]

    def rank_fn(ctx: Context) -> list[np.ndarray]:
        register_small_segments(ctx)
        out = []
        for seed, (op, size) in enumerate(cases):
            x = make_input(ctx.rank, seed, size, dtype)
            before = x.copy()
            y = ctx.allreduce(x, op=op, algorithm=algorithm)
            assert y is not x and np.array_equal(x, before), "allreduce must not modify its input"
            out.append(y)
        return out

    results = run_ranks(n, rank_fn, timeout=30)
    for seed, (op, size) in enumerate(cases):
        inputs = [make_input(r, seed, size, dtype) for r in range(n)]
        assert_reduced([results[r][seed] for r in range(n)], inputs, op, dtype)


@pytest.mark.parametrize(
    ("n", "algorithm", "dtype", "op", "size"),
    [
        (3, "ring", "float32", "sum", 1_000_003),
        (2, "ring", "int64", "mean", 1 << 20),
        (4, "tree", "float64", "max", 1 << 20),
        (4, "auto", "float32", "mean", (1025, 1031)),
    ],
)
def test_allreduce_large(n: int, algorithm: str, dtype: str, op: str, size: int | tuple[int, ...]) -> None:
    results = run_ranks(n, lambda ctx: ctx.allreduce(make_input(ctx.rank, 7, size, dtype), op, algorithm), timeout=50)
    assert_reduced(results, [make_input(r, 7, size, dtype) for r in range(n)], op, dtype)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
def test_allreduce_over_real_sockets(algorithm: str) -> None:
    sizes = [0, 5, 1009, 300_001]  # the last one is sent zero-copy, in several ring segments

    def rank_fn(ctx: Context) -> list[np.ndarray]:
        return [ctx.allreduce(make_input(ctx.rank, i, s, "float32"), "sum", algorithm) for i, s in enumerate(sizes)]

    results = run_ranks(3, rank_fn, transport="zmq", timeout=30)
    for i, size in enumerate(sizes):
        assert_reduced([r[i] for r in results], [make_input(r, i, size, "float32") for r in range(3)], "sum", "float32")


def test_allreduce_0d_and_multidimensional() -> None:
    def rank_fn(ctx: Context) -> list[np.ndarray]:
        scalar = ctx.allreduce(np.array(ctx.rank + 0.5), op="sum")
        cube = ctx.allreduce(np.full((2, 3, 4), ctx.rank, dtype=np.int32), op="max", algorithm="ring")
        return [scalar, cube]

    for scalar, cube in run_ranks(3, rank_fn):
        assert scalar.shape == () and scalar.dtype == np.float64 and float(scalar) == 4.5
        assert cube.shape == (2, 3, 4) and np.all(cube == 2)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_allreduce_torch_tensors(algorithm: str, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    n = 3
    torch_dtype = getattr(torch, dtype)
    cases = [(op, size) for op in OPS for size in (0, 1, 4, 1009)]

    def tensor(rank: int, seed: int, size: int) -> Any:
        return torch.from_numpy(make_input(rank, seed, size, "float32")).to(torch_dtype)

    def rank_fn(ctx: Context) -> list[Any]:
        out = []
        for seed, (op, size) in enumerate(cases):
            x = tensor(ctx.rank, seed, size)
            y = ctx.allreduce(x, op=op, algorithm=algorithm)
            assert isinstance(y, torch.Tensor) and y.dtype == torch_dtype and y.shape == x.shape
            out.append(y)
        return out

    results = run_ranks(n, rank_fn)
    for seed, (op, size) in enumerate(cases):
        inputs = [tensor(r, seed, size).float().numpy() for r in range(n)]
        got = [results[r][seed].float().numpy() for r in range(n)]
        assert all(np.array_equal(g, got[0]) for g in got)
        want = expected(inputs, op)
        np.testing.assert_allclose(got[0], want, **tolerance(dtype, n))


def test_allreduce_in_place_returns_the_same_object() -> None:
    torch = pytest.importorskip("torch")

    def rank_fn(ctx: Context) -> None:
        for algorithm in ("ring", "tree", "direct", SMALL_RING):
            register_small_segments(ctx)
            x = np.arange(10, dtype=np.float64) * (ctx.rank + 1)
            assert ctx.allreduce_(x, algorithm=algorithm) is x
            assert np.array_equal(x, np.arange(10) * 6.0)
        strided = np.zeros((4, 6), dtype=np.int64)
        view = strided[:, ::2]  # not contiguous: reduced through a copy, written back
        view[...] = ctx.rank + 1
        assert ctx.allreduce_(view, op="sum") is view
        assert np.all(strided[:, ::2] == 6) and np.all(strided[:, 1::2] == 0)
        t = torch.full((5,), float(ctx.rank), dtype=torch.bfloat16)
        assert ctx.allreduce_(t, op="max") is t
        assert t.tolist() == [2.0] * 5
        tt = torch.ones(3, 4).t()  # non-contiguous tensor
        assert ctx.allreduce_(tt) is tt and bool((tt == 3).all())
        readonly = np.ones(3)
        readonly.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            ctx.allreduce_(readonly)

    run_ranks(3, rank_fn)


def test_allreduce_async_handles_complete_in_call_order() -> None:
    def rank_fn(ctx: Context) -> list[list[float]]:
        xs = [np.full(3, float(i + ctx.rank)) for i in range(6)]
        handles = [ctx.allreduce_async(x, algorithm=("ring", "tree", "auto")[i % 3]) for i, x in enumerate(xs)]
        for x in xs:
            x[...] = -1  # the call copied its input: changes now must not leak into the results
        between = ctx.allreduce(np.ones(2))  # a blocking call between async ones
        assert between.tolist() == [2.0, 2.0]
        return [h.wait(timeout=20).tolist() for h in handles]

    for result in run_ranks(2, rank_fn):
        assert result == [[2.0 * i + 1] * 3 for i in range(6)]


def test_allreduce_async_reports_errors_at_wait() -> None:
    def rank_fn(ctx: Context) -> str:
        handle = ctx.allreduce_async(np.ones(2 + ctx.rank))
        with pytest.raises(CollectiveMismatchError) as info:
            handle.wait(timeout=20)
        assert ctx.allreduce_async(np.ones(2)).wait(timeout=20).tolist() == [2.0, 2.0]
        return str(info.value)

    assert len(set(run_ranks(2, rank_fn))) == 1


# -- world size 1 and argument checks ---------------------------------------------------------------------------


def test_world_of_one_copies_and_validates() -> None:
    def rank_fn(ctx: Context) -> None:
        x = np.arange(5, dtype=np.int32)
        for op in OPS:
            y = ctx.allreduce(x, op=op)
            assert y is not x and np.array_equal(y, x) and y.dtype == x.dtype
        assert ctx.broadcast(x) is not x
        assert np.array_equal(ctx.allgather(x), x)
        assert np.array_equal(ctx.reduce_scatter(x), x)
        assert ctx.allreduce_async(x).wait(5).tolist() == x.tolist()
        with pytest.raises(ValueError, match="'auto', 'ring', 'tree', 'direct'"):
            ctx.allreduce(x, algorithm="butterfly")
        with pytest.raises(ValueError, match="sum, mean, max, min"):
            ctx.allreduce(x, op="prod")
        with pytest.raises(TypeError, match="bool"):
            ctx.allreduce(np.ones(2, dtype=bool))
        with pytest.raises(TypeError, match="numpy arrays or torch"):
            ctx.allreduce([1, 2, 3])
        with pytest.raises(ValueError, match="axis 0"):
            ctx.reduce_scatter(np.array(1.0))
        with pytest.raises(ValueError, match="root"):
            ctx.broadcast(x, root=1)

    run_ranks(1, rank_fn)


def test_bool_max_min_reduce_as_or_and() -> None:
    def rank_fn(ctx: Context) -> tuple[list[bool], list[bool]]:
        x = np.array([ctx.rank == 0, True, False])
        return ctx.allreduce(x, op="max").tolist(), ctx.allreduce(x, op="min").tolist()

    assert run_ranks(2, rank_fn) == [([True, True, False], [False, True, False])] * 2


def test_module_level_functions_use_the_current_context() -> None:
    n = 2
    fabric = InprocFabric(n, timeout=20)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            pt.init(transport="inproc", fabric=fabric, rank=rank, world_size=n, env={})
            x = np.array([rank + 1.0, 2.0])
            results[rank] = (
                pt.allreduce(x).tolist(),
                pt.allreduce_(x.copy(), op="max").tolist(),
                pt.allreduce_async(x, op="min").wait(10).tolist(),
                pt.broadcast(x, root=1).tolist(),
                pt.allgather(x).tolist(),
                pt.reduce_scatter(x).tolist(),
            )
        except BaseException as exc:  # reported below
            errors.append(exc)
            fabric.fail_all(exc)
        finally:
            pt.shutdown()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert results[0] == ([3.0, 4.0], [2.0, 2.0], [1.0, 2.0], [2.0, 2.0], [1.0, 2.0, 2.0, 2.0], [3.0])
    assert results[1][5] == [4.0]


# -- broadcast, allgather, reduce_scatter -------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["tree", "chain", "auto", "chain-64B"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_broadcast_from_every_root(n: int, algorithm: str) -> None:
    shapes: list[tuple[int, ...]] = [(), (0,), (1009,), (3, 5)]

    def rank_fn(ctx: Context) -> list[np.ndarray]:
        register_small_segments(ctx)
        out = []
        for root in range(n):
            for i, shape in enumerate(shapes):
                x = make_input(ctx.rank, 100 * root + i, shape, "float32")
                y = ctx.broadcast(x, root=root, algorithm=algorithm)
                assert y is not x
                out.append(y)
        return out

    results = run_ranks(n, rank_fn, timeout=30)
    k = 0
    for root in range(n):
        for i, shape in enumerate(shapes):
            want = make_input(root, 100 * root + i, shape, "float32")
            for r in range(n):
                assert results[r][k].shape == want.shape and np.array_equal(results[r][k], want), (root, shape, r)
            k += 1


def test_broadcast_large_over_real_sockets_and_torch() -> None:
    torch = pytest.importorskip("torch")

    def rank_fn(ctx: Context) -> tuple[np.ndarray, Any]:
        big = ctx.broadcast(np.full(1 << 20, float(ctx.rank), dtype=np.float32), root=1, algorithm="chain")
        small = ctx.broadcast(torch.full((3,), float(ctx.rank), dtype=torch.bfloat16), root=2)
        return big, small

    for big, small in run_ranks(3, rank_fn, transport="zmq", timeout=30):
        assert np.all(big == 1.0)
        assert small.dtype == torch.bfloat16 and small.tolist() == [2.0] * 3


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_allgather_with_unequal_first_dimensions(n: int) -> None:
    rows = [(2 * r + 1) % 4 for r in range(n)]  # includes a rank with 0 rows when n == 4... and 3 rows

    def rank_fn(ctx: Context) -> list[np.ndarray]:
        block = make_input(ctx.rank, 5, (rows[ctx.rank], 3), "int64")
        scalar = np.array(float(ctx.rank))
        big = make_input(ctx.rank, 6, (1000 * (ctx.rank + 1), 7), "float32")
        return [ctx.allgather(block), ctx.allgather(scalar), ctx.allgather(big)]

    results = run_ranks(n, rank_fn)
    blocks = np.concatenate([make_input(r, 5, (rows[r], 3), "int64") for r in range(n)])
    bigs = np.concatenate([make_input(r, 6, (1000 * (r + 1), 7), "float32") for r in range(n)])
    for got_blocks, got_scalars, got_big in results:
        assert np.array_equal(got_blocks, blocks) and got_blocks.dtype == np.int64
        assert got_scalars.tolist() == [float(r) for r in range(n)]
        assert np.array_equal(got_big, bigs)


def test_allgather_torch_and_mismatched_trailing_dimensions() -> None:
    torch = pytest.importorskip("torch")

    def rank_fn(ctx: Context) -> str:
        got = ctx.allgather(torch.full((ctx.rank + 1, 2), ctx.rank, dtype=torch.int32))
        assert isinstance(got, torch.Tensor) and got.tolist() == [[0, 0], [1, 1], [1, 1]]
        with pytest.raises(CollectiveMismatchError) as info:
            ctx.allgather(np.zeros((2, 3 + ctx.rank)))
        return str(info.value)

    messages = run_ranks(2, rank_fn)
    assert len(set(messages)) == 1
    assert "rank 0 has shape (2, 3) float64 but rank 1 has (2, 4) float64" in messages[0]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reduce_scatter_splits_like_array_split(n: int, op: str) -> None:
    lengths = sorted({0, 1, max(n - 1, 0), n + 1, 1009})

    def rank_fn(ctx: Context) -> list[np.ndarray]:
        return [ctx.reduce_scatter(make_input(ctx.rank, k, (k, 2), "int32"), op=op) for k in lengths]

    results = run_ranks(n, rank_fn)
    for i, k in enumerate(lengths):
        want = np.array_split(expected([make_input(r, k, (k, 2), "int32") for r in range(n)], op), n)
        for r in range(n):
            assert results[r][i].dtype == np.int32
            assert results[r][i].shape == want[r].shape and np.array_equal(results[r][i], want[r]), (k, r)


def test_reduce_scatter_large_and_torch() -> None:
    torch = pytest.importorskip("torch")
    n = 3

    def rank_fn(ctx: Context) -> tuple[np.ndarray, Any]:
        big = ctx.reduce_scatter(make_input(ctx.rank, 1, (300_001, 4), "float32"), op="mean")
        tensor = ctx.reduce_scatter(torch.ones(7, 2) * (ctx.rank + 1))
        return big, tensor

    results = run_ranks(n, rank_fn, transport="zmq", timeout=30)
    want = np.array_split(expected([make_input(r, 1, (300_001, 4), "float32") for r in range(n)], "mean"), n)
    for r, (big, tensor) in enumerate(results):
        np.testing.assert_allclose(big, want[r], **tolerance("float32", n))
        assert isinstance(tensor, torch.Tensor) and tensor.shape == (3 if r == 0 else 2, 2)
        assert bool((tensor == 6).all())


# -- mismatches and failures --------------------------------------------------------------------------------------

Call = Callable[[Context], Any]


def _equal_bytes_allreduce(ctx: Context, algorithm: str) -> Any:
    """Arrays of equal byte counts but different shapes: the flat data would fit, the call must still fail."""
    return ctx.allreduce(np.zeros((17, 1311) if ctx.rank == 0 else (17, 23, 57), np.float32), algorithm=algorithm)


MISMATCHES: list[tuple[str, Call, str]] = [
    (
        "shape",
        lambda ctx: ctx.allreduce(np.zeros(4 + ctx.rank, dtype=np.float32)),
        "rank 0 has shape (4,) float32 but rank 1 has (5,) float32",
    ),
    (
        "dtype",
        lambda ctx: ctx.allreduce(np.zeros(4, dtype=np.float32 if ctx.rank == 0 else np.int32)),
        "rank 0 has shape (4,) float32 but rank 1 has (4,) int32",
    ),
    ("op", lambda ctx: ctx.allreduce(np.zeros(4), op=OPS[ctx.rank]), "rank 0 has op 'sum' but rank 1 has op 'mean'"),
    (
        "algorithm",
        lambda ctx: ctx.allreduce(np.zeros(4), algorithm=["ring", "tree"][ctx.rank]),
        "rank 0 has algorithm 'ring' but rank 1 has algorithm 'tree'",
    ),
    (
        "size implies different algorithms",
        lambda ctx: ctx.allreduce(np.zeros(4 if ctx.rank == 0 else 1 << 16)),
        "rank 0 has shape (4,) float64 but rank 1 has (65536,) float64",
    ),
    ("root", lambda ctx: ctx.broadcast(np.zeros(4), root=ctx.rank), "rank 0 has root 0 but rank 1 has root 1"),
    (
        "kind",
        lambda ctx: ctx.allreduce(np.zeros(4)) if ctx.rank == 0 else ctx.broadcast(np.zeros(4)),
        "rank 0 called allreduce but rank 1 called broadcast",
    ),
    *[
        (
            f"same bytes, other shape ({algorithm})",
            functools.partial(_equal_bytes_allreduce, algorithm=algorithm),
            "rank 0 has shape (17, 1311) float32 but rank 1 has (17, 23, 57) float32",
        )
        for algorithm in ("ring", "tree", "direct", "halving_doubling", "torus", "double_tree")
    ],
    (
        "broadcast, same bytes, other shape",
        lambda ctx: ctx.broadcast(np.zeros((6, 4) if ctx.rank == 0 else (4, 6)), algorithm="chain"),
        "rank 0 has shape (6, 4) float64 but rank 1 has (4, 6) float64",
    ),
    (
        "reduce_scatter, same bytes, other shape",
        lambda ctx: ctx.reduce_scatter(np.zeros((6, 4) if ctx.rank == 0 else (4, 6))),
        "rank 0 has shape (6, 4) float64 but rank 1 has (4, 6) float64",
    ),
    (
        "reduce_scatter op",
        lambda ctx: ctx.reduce_scatter(np.zeros(4), op=OPS[ctx.rank]),
        "rank 0 has op 'sum' but rank 1 has op 'mean'",
    ),
    (
        "allgather dtype",
        lambda ctx: ctx.allgather(np.zeros(3, dtype=np.int64 if ctx.rank == 0 else np.float64)),
        "rank 0 has shape (3,) int64 but rank 1 has (3,) float64",
    ),
]


@pytest.mark.parametrize(("what", "call", "message"), MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatch_raises_on_every_rank_and_ranks_stay_usable(what: str, call: Call, message: str) -> None:
    def rank_fn(ctx: Context) -> str:
        with pytest.raises(CollectiveMismatchError) as info:
            call(ctx)
        # the next correct collectives work: nothing of the failed call is left in flight
        assert ctx.allreduce(np.ones(3), algorithm="ring").tolist() == [2.0, 2.0, 2.0]
        assert ctx.allreduce(np.ones(3), algorithm="tree").tolist() == [2.0, 2.0, 2.0]
        return str(info.value)

    messages = run_ranks(2, rank_fn)
    assert len(set(messages)) == 1, "every rank must raise the same error"
    assert message in messages[0]


def test_mismatch_on_a_middle_rank_of_four() -> None:
    def rank_fn(ctx: Context) -> str:
        with pytest.raises(CollectiveMismatchError) as info:
            ctx.allreduce(np.zeros(3 if ctx.rank != 2 else 2), algorithm="ring")
        return str(info.value)

    messages = run_ranks(4, rank_fn)
    assert len(set(messages)) == 1 and "rank 0 has shape (3,) float64 but rank 2 has (2,) float64" in messages[0]


REJECTIONS: list[tuple[str, Call]] = [
    ("allreduce op", lambda ctx: ctx.allreduce(np.ones(2), op="average" if ctx.rank == 1 else "sum")),
    ("allreduce algorithm", lambda ctx: ctx.allreduce(np.ones(2), algorithm="butterfly" if ctx.rank == 1 else "ring")),
    ("broadcast root", lambda ctx: ctx.broadcast(np.ones(2), root=9 if ctx.rank == 1 else 0)),
    ("reduce_scatter 0-d", lambda ctx: ctx.reduce_scatter(np.array(1.0) if ctx.rank == 1 else np.ones(3))),
    ("allgather type", lambda ctx: ctx.allgather([1.0] if ctx.rank == 1 else np.ones(1))),
    (
        "async allreduce op",
        lambda ctx: ctx.allreduce_async(np.ones(2), op="average" if ctx.rank == 1 else "sum").wait(20),
    ),
]


@pytest.mark.parametrize(("what", "call"), REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_a_rank_rejecting_its_arguments_fails_the_others_at_once(what: str, call: Call) -> None:
    """Rank 1's own checks fail: it raises its ValueError/TypeError, the others a CollectiveMismatchError from the
    agreement (not a timeout: the call's timeout is 60 s), and the tags stay in step for the next calls."""

    def rank_fn(ctx: Context) -> str:
        try:
            call(ctx)
        except (ValueError, TypeError) as exc:
            message = f"{type(exc).__name__}: {exc}"
        else:
            message = "no error"
        assert ctx.allreduce(np.ones(3), algorithm="ring").tolist() == [3.0, 3.0, 3.0]
        assert ctx.broadcast(np.full(2, ctx.rank), root=2).tolist() == [2, 2]
        return message

    messages = run_ranks(3, rank_fn, timeout=60)
    assert messages[1].startswith(("ValueError: ", "TypeError: ")), messages
    for message in (messages[0], messages[2]):
        assert message.startswith("CollectiveMismatchError: ") and "rank 1 rejected its own arguments" in message


@pytest.mark.parametrize("algorithm", ["ring", "tree", "direct", "halving_doubling", "torus", "double_tree"])
def test_dead_rank_is_peer_lost_not_a_hang(algorithm: str) -> None:
    def rank_fn(ctx: Context) -> str:
        if ctx.rank == 2:
            ctx.transport.abort()  # as if the process crashed before the collective
            return "dead"
        try:
            ctx.allreduce(np.ones(1000), algorithm=algorithm, timeout=20)
        except PeerLostError:
            return "peer lost"
        return "completed"

    assert run_ranks(3, rank_fn, timeout=30) == ["peer lost", "peer lost", "dead"]


def test_rank_that_never_calls_times_out() -> None:
    def rank_fn(ctx: Context) -> None:
        if ctx.rank == 0:
            ctx.allreduce(np.ones(4), timeout=0.2)
        else:
            ctx.transport.recv(0, 99, timeout=30)  # woken by the harness when rank 0 fails

    with pytest.raises(CommTimeoutError, match=r"allreduce .* not complete after 0.2s"):
        run_ranks(2, rank_fn)


def test_allreduce_async_in_place_reads_x_only_once_ready_is_synchronized() -> None:
    """``ready=`` (in the torch front end: a CUDA event behind the copies that fill a pinned buffer): the background
    thread waits on it before it reads ``x``, so bytes that land in ``x`` after the call returned, before ``ready``
    is released, are the ones reduced. Deterministic: the write happens before the release, the read after it."""

    class Gate:
        def __init__(self) -> None:
            self.released = threading.Event()
            self.waited = False

        def query(self) -> bool:
            self.waited = True
            return self.released.is_set()

    def fn(ctx: Context) -> tuple[list[float], bool]:
        x = np.zeros(4)
        gate = Gate()
        handle = ctx.allreduce_async_(x, ready=gate)
        x[:] = ctx.rank + 1  # the "copy" lands only now
        gate.released.set()
        return handle.wait(30).tolist(), gate.waited

    assert run_ranks(2, fn) == [([3.0] * 4, True)] * 2


def test_a_device_copy_that_never_completes_fails_every_rank_at_once() -> None:
    """A ``ready`` event that never completes (a stuck kernel or copy on rank 0's GPU) is waited for at most the
    call's timeout: rank 0 raises ``DeviceTimeoutError`` and rank 1, whose own timeout is far longer, is told at
    once (a ``CollectiveMismatchError`` naming rank 0), instead of hanging in the device wait or timing out."""

    class Never:
        def query(self) -> bool:
            return False

    def fn(ctx: Context) -> str:
        stuck = ctx.rank == 0
        x = np.ones(4)
        try:
            ctx.allreduce_async_(x, ready=Never() if stuck else None, timeout=0.3 if stuck else 60).wait(60)
        except (DeviceTimeoutError, CollectiveMismatchError) as exc:
            return type(exc).__name__ + ": " + str(exc)
        return "no error"

    stuck, told = run_ranks(2, fn, timeout=60)
    assert stuck.startswith("DeviceTimeoutError: the copies into an allreduce's buffer did not complete")
    assert told.startswith("CollectiveMismatchError:") and "rank 0 rejected its own arguments" in told
