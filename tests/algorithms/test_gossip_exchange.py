"""D-PSGD's exchange without torch: every neighbour's arrays arrive intact, on sockets and in shared memory alike."""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from paratrain import Context
from paratrain.errors import CommTimeoutError, ConfigError
from paratrain.gossip.exchange import NeighbourExchange, ShmExchange, SocketExchange, open_exchange
from paratrain.gossip.mixing import neighbors, resolve_mixing
from paratrain.gossip.plan import round_plan
from paratrain.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

RUN_ID = f"test{os.getpid()}x{secrets.token_hex(3)}"
BACKENDS = [
    "sockets",
    pytest.param(
        "shm", marks=pytest.mark.skipif(not ShmExchange.supported(), reason="the shared-memory path needs x86-64")
    ),
]


def _arrays(rank: int, k: int) -> list[npt.NDArray[Any]]:
    """What rank ``rank`` posts in exchange ``k``: buckets of several dtypes and sizes, an empty one included."""
    base = 100.0 * rank + k
    return [
        np.arange(5, dtype=np.float32) + base,
        np.full(3, -base, dtype=np.float64),
        np.zeros(0, dtype=np.float32),
        np.full(7, rank * 10 + k, dtype=np.int16),  # a 16-bit bucket (what bfloat16 travels as), odd length
    ]


def _open(ctx: Context, backend: str, w: npt.NDArray[np.float64], timeout: float = 20.0) -> NeighbourExchange:
    return open_exchange(
        ctx.transport,
        neighbors=neighbors(w, ctx.rank),
        next_tag=ctx.next_collective_tag,
        timeout=timeout,
        shared_memory=backend == "shm",
        run_id=RUN_ID,
        nbytes=sum(a.nbytes for a in _arrays(0, 0)),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("topology", "world"), [("ring", 4), ("complete", 3), ("ring", 1)])
def test_every_neighbour_sends_its_arrays_each_round(backend: str, topology: str, world: int) -> None:
    w = resolve_mixing(topology, world)[0]
    rounds = 4

    def body(ctx: Context) -> list[list[tuple[int, float, list[list[float]]]]]:
        ex = _open(ctx, backend, w)
        assert ex.shared_memory == (backend == "shm")
        seen = []
        for k in range(rounds):
            ex.post(_arrays(ctx.rank, k))
            assert ex.in_flight
            seen.append([(peer, weight, [a.tolist() for a in arrays]) for peer, weight, arrays in ex.wait()])
            assert not ex.in_flight
        ex.close()
        return seen

    plan = round_plan(w, 1)
    for rank, seen in enumerate(run_ranks(world, body)):
        senders = sorted(src for src, dst, _ in plan if dst == rank)
        for k, got in enumerate(seen):
            assert [peer for peer, _, _ in got] == senders
            for peer, weight, arrays in got:
                assert weight == w[rank, peer]
                assert arrays == [a.tolist() for a in _arrays(peer, k)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_completes_the_exchange_in_flight(backend: str) -> None:
    w = resolve_mixing("ring", 3)[0]

    def body(ctx: Context) -> None:
        ex = _open(ctx, backend, w)
        ex.post(_arrays(ctx.rank, 0))
        ex.close()  # never waited for: sockets receive it here, shared memory just leaves
        assert not ex.in_flight

    run_ranks(3, body)


def test_socket_exchange_reports_a_different_model() -> None:
    w = resolve_mixing("ring", 2)[0]

    def body(ctx: Context, mine: list[npt.NDArray[Any]], theirs: list[npt.NDArray[Any]]) -> str:
        ex = _open(ctx, "sockets", w)
        ex.post(mine if ctx.rank == 0 else theirs)
        try:
            ex.wait()
        except RuntimeError as exc:
            return str(exc)
        finally:
            ex.close()
        return "no error"

    def run(mine: list[npt.NDArray[Any]], theirs: list[npt.NDArray[Any]]) -> list[str]:
        return run_ranks(2, lambda ctx: body(ctx, mine, theirs))

    one, two = [np.zeros(3, np.float32)], [np.zeros(3, np.float32), np.zeros(1, np.float32)]
    assert run(one, two)[0] == (
        "gossip: rank 1 sent 2 buffers, expected 1; every worker must build the same model and strategy"
    )
    assert run(one, [np.zeros(4, np.float32)])[0] == (
        "gossip: rank 1 sent 4 values for a bucket of 3; every worker must build the same model"
    )


def test_misuse_and_bad_arguments() -> None:
    def body(ctx: Context) -> None:
        ex = SocketExchange(ctx.transport, neighbors=[(1 - ctx.rank, 0.5)], next_tag=ctx.next_collective_tag, timeout=5)
        with pytest.raises(RuntimeError, match="post\\(\\) first"):
            ex.wait()
        ex.post([np.zeros(2)])
        with pytest.raises(RuntimeError, match="wait\\(\\) for it first"):
            ex.post([np.zeros(2)])
        ex.close()
        for bad in ([(ctx.rank, 0.5)], [(2, 0.5)]):
            with pytest.raises(ConfigError, match="cannot exchange"):
                SocketExchange(ctx.transport, neighbors=bad, next_tag=ctx.next_collective_tag, timeout=5)
        with pytest.raises(ConfigError, match="timeout"):
            SocketExchange(ctx.transport, neighbors=[], next_tag=ctx.next_collective_tag, timeout=0)

    run_ranks(2, body)


def test_a_silent_neighbour_times_out() -> None:
    gave_up = threading.Event()

    def body(ctx: Context) -> str:
        ex = SocketExchange(
            ctx.transport, neighbors=[(1 - ctx.rank, 0.5)], next_tag=ctx.next_collective_tag, timeout=0.3
        )
        if ctx.rank == 1:  # never posts; stays until rank 0 has given up
            assert gave_up.wait(30)
            return "silent"
        ex.post([np.zeros(2)])
        try:
            ex.wait()
        except CommTimeoutError as exc:
            return "timed out: " + str(exc)
        finally:
            gave_up.set()
        return "no error"

    assert run_ranks(2, body)[0].startswith("timed out: ")
