"""Barrier: nobody leaves before everybody arrived, for every world size; failures wake the others."""

from __future__ import annotations

import threading

import pytest

from paratrain import Context
from paratrain.errors import CommTimeoutError, PeerLostError
from paratrain.testing import RankFailedError, run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 8])
def test_nobody_leaves_before_all_arrive(world_size: int) -> None:
    # Each rank records its arrival, then passes a barrier and checks that everybody's arrival is recorded.
    # A barrier that let a rank through early would see a missing arrival in some round.
    rounds = 10
    arrived = [[threading.Event() for _ in range(world_size)] for _ in range(rounds)]

    def rank_fn(ctx: Context) -> int:
        for k in range(rounds):
            arrived[k][ctx.rank].set()
            ctx.barrier(timeout=20)
            missing = [r for r in range(world_size) if not arrived[k][r].is_set()]
            assert not missing, f"rank {ctx.rank} left barrier {k} before ranks {missing} arrived"
        return ctx.rank

    assert run_ranks(world_size, rank_fn) == list(range(world_size))


def test_barrier_over_real_sockets() -> None:
    assert run_ranks(4, lambda ctx: [ctx.barrier(timeout=20) for _ in range(10)] and ctx.rank, transport="zmq") == [
        0,
        1,
        2,
        3,
    ]


def test_rank_that_never_arrives_times_out() -> None:
    def rank_fn(ctx: Context) -> None:
        if ctx.rank == 0:
            ctx.barrier(timeout=0.2)
        else:
            # rank 1 waits for something that never comes; the harness wakes it when rank 0 fails
            ctx.transport.recv(0, 99, timeout=30)

    with pytest.raises(CommTimeoutError, match="barrier not complete"):
        run_ranks(2, rank_fn)


def test_rank_that_dies_surfaces_as_peer_lost() -> None:
    def rank_fn(ctx: Context) -> None:
        if ctx.rank == 2:
            ctx.transport.abort()  # as if the process crashed
            return
        ctx.barrier(timeout=30)

    with pytest.raises(PeerLostError):
        run_ranks(3, rank_fn)


def test_one_rank_raising_wakes_all_others() -> None:
    def rank_fn(ctx: Context) -> None:
        if ctx.rank == 1:
            raise ValueError("boom in rank 1")
        ctx.transport.recv(1, 5, timeout=60)  # would hang for a minute without the wake-up

    with pytest.raises(ValueError, match="boom in rank 1"):
        run_ranks(4, rank_fn, timeout=30)
    assert issubclass(RankFailedError, Exception)
