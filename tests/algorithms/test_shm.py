"""Shared-memory collectives: equal to numpy on every size, dtype and op; errors instead of hangs; nothing left."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from paratrain import Context
from paratrain.collectives.api import Collectives
from paratrain.collectives.ops import bf16_to_f32, f32_to_bf16
from paratrain.collectives.shm import ShmAllreduce, ShmGroup
from paratrain.errors import CollectiveMismatchError, CommTimeoutError, ConfigError, PeerLostError, TransportError
from paratrain.testing import run_ranks

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not ShmGroup.supported(), reason="the shared-memory path needs x86-64"),
]

RUN_ID = f"test{os.getpid()}x{secrets.token_hex(3)}"
CAPACITY = 16384  # small, so that a few thousand elements already take several pipelined blocks
SMALL = 2048
SIZES = [0, 1, 97, 4097, 5003]  # plus world + 1; 97 is prime; 4097 leaves a 1-element last block
DTYPES = ["int32", "int64", "uint8", "float16", "float32", "float64", "bfloat16", "complex64", "bool"]


def _shm_files() -> list[str]:
    return (
        [n for n in os.listdir("/dev/shm") if n.startswith(f"paratrain-{RUN_ID}")] if os.path.isdir("/dev/shm") else []
    )


@pytest.fixture(autouse=True)
def _nothing_left() -> Iterator[None]:
    yield
    assert _shm_files() == [], "a shared-memory segment of the test outlived its group"


def _ops_for(name: str) -> list[str]:
    if name == "bool":
        return ["max", "min"]
    if name.startswith("complex"):
        return ["sum", "mean"]
    return ["sum", "mean", "max", "min"]


def _inputs(rank: int, n: int, name: str) -> npt.NDArray[Any]:
    """Deterministic data of one rank: small integers (no overflow) or floats in (-1, 1)."""
    rng = np.random.default_rng(1009 * rank + n)
    if name == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if name in ("int32", "int64"):
        return rng.integers(-50, 50, n).astype(name)
    if name == "uint8":
        return rng.integers(0, 50, n).astype(np.uint8)
    values = rng.uniform(-1, 1, n)
    if name == "bfloat16":
        return f32_to_bf16(values.astype(np.float32))
    if name == "complex64":
        return (values + 1j * rng.uniform(-1, 1, n)).astype(np.complex64)
    return values.astype(name)


def _check(results: list[npt.NDArray[Any]], inputs: list[npt.NDArray[Any]], op: str, name: str) -> None:
    world = len(inputs)
    for r, got in enumerate(results):  # identical bits on every rank, whatever the algorithm did
        assert got.tobytes() == results[0].tobytes(), f"rank {r} differs from rank 0 ({name}, {op})"
    got = results[0]
    if name == "bfloat16":
        got, wide = bf16_to_f32(got), np.stack([bf16_to_f32(x).astype(np.float64) for x in inputs])
    elif name == "bool":
        wide = np.stack(inputs)
    elif name in ("int32", "int64", "uint8"):
        wide = np.stack([x.astype(np.int64) for x in inputs])
    else:
        wide = np.stack([x.astype(np.complex128 if name.startswith("complex") else np.float64) for x in inputs])
    if op == "max":
        ref = wide.max(axis=0)
    elif op == "min":
        ref = wide.min(axis=0)
    elif op == "mean" and name in ("int32", "int64", "uint8"):
        ref = wide.sum(axis=0) // world
    else:
        ref = wide.sum(axis=0) / (world if op == "mean" else 1)
    if name in ("int32", "int64", "uint8", "bool"):
        np.testing.assert_array_equal(got, ref.astype(got.dtype), err_msg=f"{name} {op}")
    else:
        tol = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-5, "complex64": 1e-5}.get(name, 1e-12)
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol, err_msg=f"{name} {op}")


def _with_groups(world: int, body: Callable[[Context, ShmGroup], Any], *, timeout: float = 20.0) -> list[Any]:
    """Runs ``body(ctx, group)`` in ``world`` threads, each with its member of one fresh group."""

    def rank_fn(ctx: Context) -> Any:
        group = ShmGroup.create(
            ctx.transport,
            ranks=list(range(world)),
            run_id=RUN_ID,
            timeout=timeout,
            tag=ctx.next_collective_tag(),
            capacity=CAPACITY,
            small_bytes=SMALL,
        )
        try:
            return body(ctx, group)
        finally:
            group.close()

    return run_ranks(world, rank_fn, timeout=timeout + 20)


# -- results ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_allreduce_equals_numpy(world: int, name: str) -> None:
    cases = [(n, op) for n in [*SIZES, world + 1] for op in _ops_for(name)]

    def body(ctx: Context, group: ShmGroup) -> list[tuple[npt.NDArray[Any], npt.NDArray[Any]]]:
        out = []
        for n, op in cases:
            x = _inputs(ctx.rank, n, name)
            original = x.copy()
            group.allreduce_(x, op, dtype_name=name)
            out.append((original, x))
        return out

    per_rank = _with_groups(world, body)
    for i, (n, op) in enumerate(cases):
        inputs = [per_rank[r][i][0] for r in range(world)]
        assert all(len(x) == n for x in inputs)
        _check([per_rank[r][i][1] for r in range(world)], inputs, op, name)


def test_multidimensional_arrays_and_many_calls_in_a_row() -> None:
    # Block numbers continue across calls; alternating small and large calls exercises slot reuse.
    def body(ctx: Context, group: ShmGroup) -> list[float]:
        sums = []
        for i in range(40):
            x = np.full((3, 7 + 300 * (i % 3)), float(ctx.rank + i), dtype=np.float64)
            group.allreduce_(x, "sum")
            sums.append(float(x[2, -1]))
        return sums

    results = _with_groups(3, body)
    assert results[0] == results[2] == [float(3 * i + 3) for i in range(40)]


@pytest.mark.parametrize("root", [0, 1, 2])
def test_broadcast_from_every_root(root: int) -> None:
    def body(ctx: Context, group: ShmGroup) -> list[npt.NDArray[Any]]:
        out = []
        for n in [0, 1, 97, 5003]:
            for dtype in (np.float32, np.int64):
                x = np.arange(n, dtype=dtype) * (ctx.rank + 1)
                group.broadcast_(x, root)
                out.append(x)
        return out

    results = _with_groups(3, body)
    for r in range(3):
        for got, ref in zip(results[r], results[root], strict=True):
            np.testing.assert_array_equal(got, ref)
    assert results[0][-1][-1] == 5002 * (root + 1)


def test_publish_moves_gather_scatter_and_alltoall_blocks_of_uneven_sizes() -> None:
    """publish (what the personalized calls use inside a host): uneven sizes, arrays of many blocks and of none,
    interleaved with allreduces (the block numbers go on across calls); the reads equal numpy's slices."""
    sizes = [0, 1, 3 * CAPACITY // 8 + 5, 2 * CAPACITY // 8]  # items of float64: none, one, 3+ blocks, 2 blocks

    def body(ctx: Context, group: ShmGroup) -> list[npt.NDArray[Any]]:
        r, n = ctx.rank, 3
        mine = np.arange(sizes[r + 1], dtype=np.float64) + 1000 * r
        got = []
        own = [sizes[q + 1] for q in range(n)]
        offsets = np.cumsum([0, *own])
        out = np.full(offsets[-1] if r == 0 else 0, -1.0)  # gather to 0
        group.publish(mine, own, [(q, 0, own[q], offsets[q]) for q in range(n)] if r == 0 else [], out)
        got.append(out)
        whole = np.arange(sizes[3], dtype=np.float64) if r == 2 else np.zeros(0)  # scatter from 2, uneven parts
        parts = [(0, 7), (7, 7), (7, sizes[3])]
        part = np.full(parts[r][1] - parts[r][0], -1.0)
        group.publish(whole, [0, 0, sizes[3]], [(2, *parts[r], 0)], part)
        got.append(part)
        x = np.ones(5)
        group.allreduce_(x, "sum")
        got.append(x)
        send = np.arange(3 * 11, dtype=np.float64) + 100 * r  # all-to-all: 11 items to each
        recv = np.full(33, -1.0)
        group.publish(send, [33] * 3, [(q, 11 * r, 11 * r + 11, 11 * q) for q in range(n)], recv)
        got.append(recv)
        # the same, each rank publishing its parts in the order r + 1, r + 2, r (its part q at 11 * ((q - r - 1) % 3))
        turned = np.full(33, -1.0)
        order = [(11 * ((r + j) % 3), 11 * ((r + j) % 3) + 11) for j in (1, 2, 3)]
        reads = [(q, 11 * ((r - q - 1) % 3), 11 * ((r - q - 1) % 3) + 11, 11 * q) for q in range(n)]
        group.publish(send, [33] * 3, reads, turned, order=order)
        got.append(turned)
        return got

    results = _with_groups(3, body)
    inputs = [np.arange(sizes[q + 1], dtype=np.float64) + 1000 * q for q in range(3)]
    np.testing.assert_array_equal(results[0][0], np.concatenate(inputs))
    whole = np.arange(sizes[3], dtype=np.float64)
    for r, (a, z) in enumerate([(0, 7), (7, 7), (7, sizes[3])]):
        np.testing.assert_array_equal(results[r][1], whole[a:z])
        np.testing.assert_array_equal(results[r][2], np.full(5, 3.0))
        want = np.concatenate([np.arange(33, dtype=np.float64)[11 * r : 11 * r + 11] + 100 * q for q in range(3)])
        np.testing.assert_array_equal(results[r][3], want)
        np.testing.assert_array_equal(results[r][4], want)


def test_barrier_lets_nobody_through_early() -> None:
    rounds, world = 8, 3
    arrived = [[threading.Event() for _ in range(world)] for _ in range(rounds)]

    def body(ctx: Context, group: ShmGroup) -> None:
        for k in range(rounds):
            arrived[k][ctx.rank].set()
            group.barrier()
            assert all(e.is_set() for e in arrived[k]), f"rank {ctx.rank} left barrier {k} early"

    _with_groups(world, body)


def test_group_of_one_is_a_no_op() -> None:
    def body(ctx: Context) -> list[float]:
        group = ShmGroup.create(ctx.transport, ranks=[0], run_id=RUN_ID, timeout=5, tag=-3)
        x = np.array([1.0, 2.0])
        group.allreduce_(x, "mean")
        group.barrier()
        group.close()
        return x.tolist()

    assert run_ranks(1, body) == [[1.0, 2.0]]


def test_registered_in_the_api_as_an_algorithm() -> None:
    def body(ctx: Context) -> list[float]:
        collectives = getattr(ctx, "collectives", None)
        if collectives is None:
            pytest.skip("the collectives API is not in this build")
        from paratrain.collectives.api import AllreduceAlgorithm

        shm = ShmAllreduce(run_id=RUN_ID, capacity=CAPACITY, small_bytes=SMALL)
        collectives.allreduce_algorithms["shm"] = AllreduceAlgorithm(shm)
        try:
            x = np.arange(6000, dtype=np.float32) * (ctx.rank + 1)
            ctx.allreduce_(x, op="max", algorithm="shm")
            return [float(x[1]), float(x[-1])]
        finally:
            shm.close()

    assert run_ranks(2, body) == [[2.0, 11998.0], [2.0, 11998.0]]


# -- misuse and failures: errors on every rank, never a hang -------------------------------------------------------


# -- mismatches: every rank raises the same CollectiveMismatchError, and the group stays usable -------------------

#: (what, the call, with ``bad`` True on rank 1 only, the difference the message must name). Rank 1 of 3 deviates:
#: a mismatch on some ranks only. Sizes cover both paths: one-phase (up to SMALL bytes) and pipelined blocks.
ShmCall = Callable[[ShmGroup, bool], None]
SHM_MISMATCHES: list[tuple[str, ShmCall, str]] = [
    (
        "same bytes, other shape (pipelined)",
        lambda g, bad: g.allreduce_(np.zeros((17, 23, 57) if bad else (17, 1311), np.float32)),
        "rank 0 has shape (17, 1311) float32 but rank 1 has (17, 23, 57) float32",
    ),
    (
        "same bytes, other shape (one-phase)",
        lambda g, bad: g.allreduce_(np.zeros((4, 6) if bad else (6, 4), np.float32)),
        "rank 0 has shape (6, 4) float32 but rank 1 has (4, 6) float32",
    ),
    (
        "dtype of the same size",
        lambda g, bad: g.allreduce_(np.zeros(8, np.int32 if bad else np.float32)),
        "rank 0 has shape (8,) float32 but rank 1 has (8,) int32",
    ),
    (
        "op",
        lambda g, bad: g.allreduce_(np.zeros(8), "max" if bad else "sum"),
        "rank 0 has op 'sum' but rank 1 has op 'max'",
    ),
    (
        "root",
        lambda g, bad: g.broadcast_(np.zeros(5000), 2 if bad else 0),
        "rank 0 has root 0 but rank 1 has root 2",
    ),
    (
        "one-phase against pipelined",
        lambda g, bad: g.allreduce_(np.zeros(5000 if bad else 10, np.float32)),
        "rank 0 has shape (10,) float32 but rank 1 has (5000,) float32",
    ),
    (
        "empty against not",
        lambda g, bad: g.allreduce_(np.zeros(3 if bad else 0)),
        "rank 0 has shape (0,) float64 but rank 1 has (3,) float64",
    ),
    (
        "kind",
        lambda g, bad: g.broadcast_(np.zeros(8), 0) if bad else g.allreduce_(np.zeros(8)),
        "rank 0 called allreduce but rank 1 called broadcast",
    ),
    (
        "barrier",
        lambda g, bad: g.barrier() if bad else g.allreduce_(np.zeros(5000)),
        "rank 0 called allreduce but rank 1 called barrier",
    ),
]


def _good_calls(group: ShmGroup, rank: int) -> tuple[list[float], list[float], list[float]]:
    """Correct calls after a mismatch: both allreduce paths and a broadcast, on the same group."""
    big, small, sent = np.full(5000, rank + 1.0), np.full(3, rank + 1.0), np.arange(3.0) * rank
    group.allreduce_(big, "sum")
    group.allreduce_(small, "max")
    group.broadcast_(sent, 2)
    group.barrier()
    return [float(big[0]), float(big[-1])], small.tolist(), sent.tolist()


def _shm_mismatches(group: ShmGroup, rank: int) -> list[tuple[str, Any]]:
    """Every case of SHM_MISMATCHES on one group, each followed by correct calls: (message, their results)."""
    out: list[tuple[str, Any]] = []
    for what, call, _ in SHM_MISMATCHES:
        try:
            call(group, rank == 1)
        except CollectiveMismatchError as exc:
            out.append((str(exc), _good_calls(group, rank)))
        else:
            out.append((f"{what}: no error", None))
    return out


def _assert_mismatches_reported(per_rank: list[list[tuple[str, Any]]], cases: list[tuple[str, Any, str]]) -> None:
    world = len(per_rank)
    for i, (what, _, difference) in enumerate(cases):
        messages = {per_rank[r][i][0] for r in range(world)}
        assert len(messages) == 1, f"{what}: the ranks raised different errors: {messages}"
        message = messages.pop()
        assert difference in message, f"{what}: {message}"
        assert "all remain usable" in message


def _assert_good_results(per_rank: list[list[tuple[str, Any]]]) -> None:
    world = len(per_rank)
    total = float(sum(range(1, world + 1)))
    for r in range(world):
        for message, results in per_rank[r]:
            assert results == ([total, total], [float(world)] * 3, [0.0, 2.0, 4.0]), (r, message)


def test_mismatches_raise_on_every_rank_and_the_group_stays_usable() -> None:
    per_rank = _with_groups(3, lambda ctx, group: _shm_mismatches(group, ctx.rank))
    _assert_mismatches_reported(per_rank, SHM_MISMATCHES)
    _assert_good_results(per_rank)


def test_a_rank_rejecting_its_arguments_fails_its_peers_at_once_and_the_group_stays_usable() -> None:
    # Rank 0 passes an array that cannot be updated in place: it raises its ValueError, its peers learn it in the
    # agreement step (not at their timeout of 60 s), and nobody breaks the group.
    def body(ctx: Context, group: ShmGroup) -> tuple[str, Any]:
        x = np.zeros((4, 4), dtype=np.float32)
        try:
            group.allreduce_(x.T if ctx.rank == 0 else x, "sum", timeout=60)
        except (ValueError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}", _good_calls(group, ctx.rank)
        return "no error", None

    results = _with_groups(3, body, timeout=60)
    assert results[0][0].startswith("ValueError: the array must be C-contiguous")
    for message, _ in results[1:]:
        assert message.startswith("CollectiveMismatchError: ") and "rank 0 rejected its own arguments" in message
    _assert_good_results([[r] for r in results])


def test_argument_errors_of_every_rank_leave_the_group_usable() -> None:
    def body(ctx: Context, group: ShmGroup) -> list[float]:
        with pytest.raises(ValueError, match="unknown reduction op"):
            group.allreduce_(np.ones(3), "average")
        with pytest.raises(ValueError, match="not a member"):
            group.broadcast_(np.ones(3), 7)
        x = np.ones(3)
        group.allreduce_(x, "sum")
        return x.tolist()

    assert _with_groups(2, body) == [[2.0] * 3] * 2
    assert _with_groups(1, body) == [[1.0] * 3]


# The collectives API on one host: shm enabled, every call (whatever its algorithm) agrees through the segment.
ApiCall = Callable[[Collectives, bool], Any]
API_MISMATCHES: list[tuple[str, ApiCall, str]] = [
    (
        "allreduce, same bytes, other shape",
        lambda c, bad: c.allreduce(np.zeros((17, 23, 57) if bad else (17, 1311), np.float32)),
        "rank 0 has shape (17, 1311) float32 but rank 1 has (17, 23, 57) float32",
    ),
    (
        "allreduce dtype",
        lambda c, bad: c.allreduce(np.zeros(8, np.int32 if bad else np.float32)),
        "rank 0 has shape (8,) float32 but rank 1 has (8,) int32",
    ),
    (
        "allreduce op",
        lambda c, bad: c.allreduce_(np.zeros(8), op="max" if bad else "sum"),
        "rank 0 has op 'sum' but rank 1 has op 'max'",
    ),
    (
        "shm against a socket algorithm",
        lambda c, bad: c.allreduce(np.zeros(8), algorithm="ring" if bad else "auto"),
        "rank 0 has algorithm 'shm' (auto) but rank 1 has algorithm 'ring'",
    ),
    (
        "async allreduce",
        lambda c, bad: c.allreduce_async(np.zeros(3 if bad else 2)).wait(20),
        "rank 0 has shape (2,) float64 but rank 1 has (3,) float64",
    ),
    (
        "broadcast root",
        lambda c, bad: c.broadcast(np.zeros(8), root=2 if bad else 0),
        "rank 0 has root 0 but rank 1 has root 2",
    ),
    (
        "kind",
        lambda c, bad: c.broadcast(np.zeros(8)) if bad else c.allreduce(np.zeros(8)),
        "rank 0 called allreduce but rank 1 called broadcast",
    ),
    (
        "allgather trailing dimensions",
        lambda c, bad: c.allgather(np.zeros((2, 4 if bad else 3))),
        "rank 0 has shape (2, 3) float64 but rank 1 has (2, 4) float64 (allgather needs equal trailing dimensions)",
    ),
    (
        "reduce_scatter, same bytes, other shape",
        lambda c, bad: c.reduce_scatter(np.zeros((6, 4) if bad else (4, 6))),
        "rank 0 has shape (4, 6) float64 but rank 1 has (6, 4) float64",
    ),
]


def _api_good_calls(c: Collectives, rank: int) -> tuple[list[float], list[float], list[int]]:
    """Correct calls after a mismatch: allreduce (shm), broadcast (tree), allgather with unequal first dimensions."""
    summed = c.allreduce(np.full(3, rank + 1.0))
    sent = c.broadcast(np.arange(3.0) * rank, root=2)
    rows = c.allgather(np.full((rank + 1, 2), rank))
    return summed.tolist(), sent.tolist(), rows[:, 0].tolist()


def _api_mismatches(c: Collectives, rank: int) -> list[tuple[str, Any]]:
    assert c.choose_allreduce(8, 3) == "shm", "shared memory is not enabled: this would test the socket path"
    out: list[tuple[str, Any]] = []
    for what, call, _ in API_MISMATCHES:
        try:
            call(c, rank == 1)
        except CollectiveMismatchError as exc:
            out.append((str(exc), _api_good_calls(c, rank)))
        else:
            out.append((f"{what}: no error", None))
    # rank 1 rejects its own arguments: it raises its error, the others fail at once (not at their timeout)
    for call in (
        lambda bad: c.allreduce(np.ones(2), op="average" if bad else "sum"),
        lambda bad: c.broadcast(np.ones(2), root=9 if bad else 0),
        lambda bad: c.allreduce_async(np.ones(2), op="average" if bad else "sum").wait(20),
    ):
        try:
            call(rank == 1)
        except (ValueError, TypeError) as exc:
            out.append((f"{type(exc).__name__}: {exc}", _api_good_calls(c, rank)))
        else:
            out.append(("rejection: no error", None))
    return out


def _assert_api_results(per_rank: list[list[tuple[str, Any]]]) -> None:
    n = len(API_MISMATCHES)
    _assert_mismatches_reported([r[:n] for r in per_rank], API_MISMATCHES)
    for r, results in enumerate(per_rank):
        for i, (message, good) in enumerate(results):
            assert good == ([6.0] * 3, [0.0, 2.0, 4.0], [0, 1, 1, 2, 2, 2]), (r, message)
            if i >= n:  # the rejections
                if r == 1:
                    assert message.startswith(("ValueError: ", "TypeError: ")), message
                else:
                    assert message.startswith("CollectiveMismatchError: "), message
                    assert "rank 1 rejected its own arguments" in message


def test_api_on_one_host_reports_mismatches_of_every_collective_and_stays_usable() -> None:
    per_rank = run_ranks(3, lambda ctx: _api_mismatches(ctx.collectives, ctx.rank), transport="zmq", timeout=60)
    _assert_api_results(per_rank)


def test_api_on_one_host_creates_the_group_in_whichever_collective_comes_first() -> None:
    # The group is created over the first call's tag, here a tree broadcast whose messages use that tag too.
    def rank_fn(ctx: Context) -> tuple[list[int], list[int], list[float]]:
        assert ctx.collectives.choose_allreduce(8, 3) == "shm"
        sent = ctx.broadcast(np.arange(4) * ctx.rank, root=2)
        rows = ctx.allgather(np.full((ctx.rank + 1, 2), ctx.rank))
        summed = ctx.allreduce(np.ones(3), algorithm="direct")  # shm agreement, then the data over sockets
        return sent.tolist(), rows[:, 0].tolist(), summed.tolist()

    for result in run_ranks(3, rank_fn, transport="zmq", timeout=60):
        assert result == ([0, 2, 4, 6], [0, 1, 1, 2, 2, 2], [3.0] * 3)


def _shm_calls(c: Collectives) -> int:
    """How many allreduces the API's shared-memory group ran (private state: which path a call took)."""
    assert c._shm is not None and c._shm.group is not None
    return int(c._shm.group.phases["calls"])


def test_api_fast_path_for_in_place_arrays_matches_the_full_path() -> None:
    # allreduce_ of a contiguous numpy array on the shared-memory path skips the API's per-call checks after its
    # first call of a shape; a rank whose array does not qualify (not contiguous) takes the full path in the same
    # call. Both compare the same descriptor, reduce in rank order (bitwise equal results) and keep tags in step.
    def rank_fn(ctx: Context) -> dict[str, Any]:
        c = ctx.collectives
        rng = np.random.default_rng(ctx.rank)
        out: dict[str, Any] = {}
        c.allreduce_(np.ones(4))  # creates the group (full path)
        values = rng.standard_normal((3, 5)).astype(np.float32)
        for i in range(3):  # the first call works the shape out, the next ones use it
            if ctx.rank == 1:
                x = np.empty((5, 3), np.float32).T  # not contiguous: the full path, through a copy
                x[...] = values
            else:
                x = values.copy()
            assert c.allreduce_(x, op="sum") is x
            out[f"sum{i}"] = x.tobytes()
        out["worked out"] = (ctx.rank, sorted(key[3] for key in c._shm_calls))  # private: which ranks took it
        before = _shm_calls(c)
        m = np.full((2, 3), ctx.rank + 1, np.int64)
        c.allreduce_(m, op="max")
        out["max"] = m.tolist()
        out["shm calls"] = _shm_calls(c) - before
        out["tree broadcast after"] = c.broadcast(np.arange(3) + ctx.rank, root=1, algorithm="tree").tolist()
        c.choose_allreduce = lambda nbytes, world: "ring"  # a new policy: the worked-out calls no longer apply
        before = _shm_calls(c)
        r = np.full(4, ctx.rank + 1.0)
        c.allreduce_(r)
        out["ring"] = (r.tolist(), _shm_calls(c) - before)
        return out

    per_rank = run_ranks(2, rank_fn, transport="zmq", timeout=60)
    assert [r.pop("worked out") for r in per_rank] == [(0, [(3, 5)]), (1, [])]
    assert per_rank[0] == per_rank[1]
    result = per_rank[0]
    values = [np.random.default_rng(r).standard_normal((3, 5)).astype(np.float32) for r in (0, 1)]
    for i in range(3):
        assert result[f"sum{i}"] == (values[0] + values[1]).tobytes()
    assert result["max"] == [[2, 2, 2], [2, 2, 2]]
    assert result["shm calls"] == 1
    assert result["tree broadcast after"] == [1, 2, 3]
    assert result["ring"] == ([3.0] * 4, 0)


def test_api_fast_path_reports_mismatches_and_stays_usable() -> None:
    def rank_fn(ctx: Context) -> list[str]:
        c = ctx.collectives
        c.allreduce_(np.ones(4))
        messages = []
        for shape in [(4, 2), (4, 2)]:  # a known shape on both ranks, then rank 1's differs
            c.allreduce_(np.ones(shape, np.float32))
        for bad in ((2, 4), (8,)):
            try:
                c.allreduce_(np.ones(bad if ctx.rank == 1 else (4, 2), np.float32))
            except CollectiveMismatchError as exc:
                messages.append(str(exc))
        x = np.full((4, 2), ctx.rank + 1.0, np.float32)
        c.allreduce_(x)
        messages.append(str(x.ravel().tolist()))
        return messages

    per_rank = run_ranks(2, rank_fn, transport="zmq", timeout=60)
    assert per_rank[0] == per_rank[1]
    first, second, after = per_rank[0]
    assert "rank 0 has shape (4, 2) float32 but rank 1 has (2, 4) float32" in first
    assert "rank 0 has shape (4, 2) float32 but rank 1 has (8,) float32" in second
    assert after == str([3.0] * 8)


def test_absent_peer_times_out_and_breaks_the_group() -> None:
    gave_up = threading.Event()

    def body(ctx: Context, group: ShmGroup) -> str:
        if ctx.rank == 1:  # never enters the collective; stays alive until rank 0 has given up
            assert gave_up.wait(30)
            return "absent"
        try:
            group.allreduce_(np.ones(8), "sum", timeout=0.3)
        except CommTimeoutError as exc:
            message = str(exc)
        finally:
            gave_up.set()
        with pytest.raises(TransportError, match="broken by an earlier error"):  # a timeout does break it
            group.allreduce_(np.ones(8), "sum")
        return message

    message, _ = _with_groups(2, body)
    assert "did not reach" in message


def test_peer_that_closes_fails_the_waiter() -> None:
    def body(ctx: Context, group: ShmGroup) -> str:
        if ctx.rank == 1:
            return "closed"  # _with_groups closes the group
        try:
            group.allreduce_(np.ones(8), "sum", timeout=30)
        except PeerLostError as exc:
            return str(exc)
        return "no error"

    assert "closed its shared-memory group" in _with_groups(2, body, timeout=30)[0]


def test_bad_arguments() -> None:
    def body(ctx: Context) -> None:
        with pytest.raises(ConfigError, match="capacity"):
            ShmGroup.create(ctx.transport, ranks=[0, 1], run_id=RUN_ID, timeout=5, tag=-3, capacity=1000)
        with pytest.raises(ConfigError, match="not among"):
            ShmGroup.create(ctx.transport, ranks=[1], run_id=RUN_ID, timeout=5, tag=-3)

    run_ranks(1, body)


def test_refuses_weakly_ordered_architectures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    assert not ShmGroup.supported()
    with pytest.raises(ConfigError, match="x86-64"):
        run_ranks(1, lambda ctx: ShmGroup.create(ctx.transport, ranks=[0], run_id=RUN_ID, timeout=5, tag=-3))


def test_no_segment_file_remains_once_created() -> None:
    # The creator unlinks the name as soon as everyone mapped it: a crash later cannot leak it.
    assert _with_groups(3, lambda ctx, group: _shm_files()) == [[], [], []]


# -- real processes -------------------------------------------------------------------------------------------------

PROC_CASES = [(n, name, op) for n in (1, 97, 5003) for name in ("int64", "float32") for op in ("sum", "max")]


def _proc_rank(rank: int, world: int, conn: Any, scenario: str) -> None:
    """One rank in its own process: joins over ZeroMQ (endpoints through the pipe), then runs the scenario."""
    from paratrain.transport.zmq import ZmqTransport

    transport = ZmqTransport(rank=rank, world_size=world, host_id="local", run_id=RUN_ID, timeout=20)
    try:
        conn.send(transport.endpoints())
        if not conn.poll(30):
            return
        transport.connect(conn.recv())
        group = ShmGroup.create(
            transport, ranks=list(range(world)), run_id=RUN_ID, timeout=20, tag=-7, capacity=CAPACITY, small_bytes=SMALL
        )
        if scenario == "allreduce":
            out = []
            for n, name, op in PROC_CASES:
                x = _inputs(rank, n, name)
                group.allreduce_(x, op)
                out.append(x)
            conn.send(("ok", out))
        elif scenario == "mismatch":  # the mismatch tables, on the group itself and through the collectives API
            try:
                shm_results = _shm_mismatches(group, rank)
                api = Collectives(transport=transport, next_tag=itertools.count(1000).__next__, timeout=20)
                try:
                    assert api.enable_shared_memory(RUN_ID)
                    api_results = _api_mismatches(api, rank)
                finally:
                    api.close()
                conn.send(("ok", shm_results, api_results))
            except Exception:
                conn.send(("error", traceback.format_exc()))
        else:  # "die": the last rank exits right after publishing its first block, in the middle of the call
            if rank == world - 1:
                signal = group.segment.signal

                def signal_then_die(value: int) -> None:
                    signal(value)
                    os._exit(3)

                group.segment.signal = signal_then_die  # type: ignore[method-assign]
            start = time.monotonic()
            try:
                group.allreduce_(np.ones(50_000, dtype=np.float32), "sum")
                conn.send(("no error", 0.0))
            except Exception as exc:
                conn.send((type(exc).__name__, time.monotonic() - start))
        group.close()
    finally:
        transport.close()


def _run_processes(world: int, scenario: str) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(world)]
    procs = [ctx.Process(target=_proc_rank, args=(r, world, pipes[r][1], scenario)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        table = []
        for parent, _ in pipes:
            assert parent.poll(30), "a rank did not start"
            table.append(parent.recv())
        for parent, _ in pipes:
            parent.send(table)
        results = []
        for r, (parent, _) in enumerate(pipes):
            alive = r != world - 1 or scenario != "die"
            results.append(parent.recv() if alive and parent.poll(30) else None)
        return results
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def test_allreduce_across_processes() -> None:
    world = 3
    results = _run_processes(world, "allreduce")
    assert all(r is not None and r[0] == "ok" for r in results), results
    for i, (n, name, op) in enumerate(PROC_CASES):
        _check([results[r][1][i] for r in range(world)], [_inputs(r, n, name) for r in range(world)], op, name)


def test_mismatches_across_processes_raise_on_every_rank_and_groups_stay_usable() -> None:
    results = _run_processes(3, "mismatch")
    assert all(r is not None and r[0] == "ok" for r in results), results
    _assert_mismatches_reported([r[1] for r in results], SHM_MISMATCHES)
    _assert_good_results([r[1] for r in results])
    _assert_api_results([r[2] for r in results])


def test_peer_dying_mid_collective_is_reported_not_hung() -> None:
    results = _run_processes(2, "die")
    name, waited = results[0]
    assert name == "PeerLostError", results
    assert waited < 15, "the death was noticed only at the timeout"
