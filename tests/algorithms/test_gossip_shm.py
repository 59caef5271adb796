"""Gossip's shared-memory neighbour exchange: neighbours read each round intact, errors instead of hangs."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from paratrain import Context
from paratrain.collectives.shm import ShmGroup
from paratrain.errors import CollectiveMismatchError, PeerLostError
from paratrain.gossip.shm import ShmExchangeGroup
from paratrain.testing import run_ranks

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not ShmExchangeGroup.supported(), reason="the shared-memory path needs x86-64"),
]

RUN_ID = f"test{os.getpid()}x{secrets.token_hex(3)}"
CAPACITY = 16384


def _shm_files() -> list[str]:
    return (
        [n for n in os.listdir("/dev/shm") if n.startswith(f"paratrain-{RUN_ID}")] if os.path.isdir("/dev/shm") else []
    )


@pytest.fixture(autouse=True)
def _nothing_left() -> Iterator[None]:
    yield
    assert _shm_files() == [], "a shared-memory segment of the test outlived its group"


def _with_groups(world: int, body: Callable[[Context, ShmExchangeGroup], Any], *, timeout: float = 20.0) -> list[Any]:
    """Runs ``body(ctx, group)`` in ``world`` threads, each with its member of one fresh exchange group."""

    def rank_fn(ctx: Context) -> Any:
        group = ShmExchangeGroup.create(
            ctx.transport,
            ranks=list(range(world)),
            run_id=RUN_ID,
            timeout=timeout,
            tag=ctx.next_collective_tag(),
            capacity=CAPACITY,
        )
        try:
            return body(ctx, group)
        finally:
            group.close()

    return run_ranks(world, rank_fn, timeout=timeout + 20)


def test_neighbour_exchange_on_a_ring_over_many_rounds() -> None:
    """Each rank reads only its two ring neighbours, 50 rounds in a row, values changing every round: the two
    slots per rank are never overwritten while a neighbour still needs them."""
    world, rounds = 4, 50

    def body(ctx: Context, group: ShmExchangeGroup) -> list[float]:
        left, right = (ctx.rank - 1) % world, (ctx.rank + 1) % world
        seen = []
        for k in range(rounds):
            group.publish(np.full(1000, 100.0 * ctx.rank + k))
            got = [group.peer_array(p, np.float64, 1000) for p in (left, right)]
            assert all(np.all(g == g[0]) for g in got)  # never a torn array
            seen.append(float(got[0][0] + got[1][0]))
        return seen

    for rank, seen in enumerate(_with_groups(world, body)):
        expected = [100.0 * ((rank - 1) % world) + 100.0 * ((rank + 1) % world) + 2 * k for k in range(rounds)]
        assert seen == expected


def test_neighbour_exchange_errors() -> None:
    def body(ctx: Context, group: ShmExchangeGroup) -> str:
        with pytest.raises(RuntimeError, match="before publish"):
            group.peer_array(1 - ctx.rank, np.uint8, 8)
        with pytest.raises(ValueError, match="not another member"):
            group.peer_array(ctx.rank, np.uint8, 8)
        group.publish(np.zeros(8 + ctx.rank, np.uint8))  # the ranks disagree on the size
        try:
            group.peer_array(1 - ctx.rank, np.uint8, 8 + ctx.rank)
        except (CollectiveMismatchError, PeerLostError) as exc:
            return type(exc).__name__ + ": " + str(exc)
        return "no error"

    messages = _with_groups(2, body)
    assert any("CollectiveMismatchError" in m and "published 8 bytes" in m for m in messages), messages

    def too_big(ctx: Context, group: ShmExchangeGroup) -> None:
        with pytest.raises(ValueError, match="capacity"):
            group.publish(np.zeros(CAPACITY + 1, np.uint8))

    def waits_for_rank_0(ctx: Context, group: ShmExchangeGroup) -> None:
        group.publish(np.zeros(1))
        group.peer_array(0, np.float64, 1)

    with pytest.raises(PeerLostError, match="rank 0 failed"):  # rank 0's failure aborted the group: no hang
        _with_groups(2, lambda ctx, group: too_big(ctx, group) if ctx.rank == 0 else waits_for_rank_0(ctx, group))

    def mixed_use(ctx: Context) -> None:  # one segment, exchanges first: its counters count exchanges
        group = ShmGroup.create(ctx.transport, ranks=[0, 1], run_id=RUN_ID, timeout=20, tag=ctx.next_collective_tag())
        try:
            ShmExchangeGroup(group.segment).publish(np.zeros(8))
            with pytest.raises(RuntimeError, match="collectives need a group of their own"):
                group.barrier()
        finally:
            group.close()

    both_done = threading.Barrier(2, timeout=30)

    def collectives_first(ctx: Context) -> None:
        group = ShmGroup.create(ctx.transport, ranks=[0, 1], run_id=RUN_ID, timeout=20, tag=ctx.next_collective_tag())
        try:
            group.barrier()
            both_done.wait()  # the refusal below breaks the group: nobody may still be inside the barrier
            with pytest.raises(RuntimeError, match="neighbour exchanges need a group of their own"):
                ShmExchangeGroup(group.segment).publish(np.zeros(8))
        finally:
            group.close()

    run_ranks(2, mixed_use, timeout=40)
    run_ranks(2, collectives_first, timeout=40)


def test_a_lost_peer_is_named_by_everyone_not_the_rank_that_noticed() -> None:
    """A path 0 - 2 - 1: rank 0 reads only rank 2. Rank 1 leaves; rank 2 notices and aborts the group; rank 0
    must be told that rank 1 was lost (the root cause), not that rank 2 failed."""

    def body(ctx: Context, group: ShmExchangeGroup) -> str:
        reads = {0: [2], 1: [2], 2: [0, 1]}[ctx.rank]
        try:
            for k in range(5):
                if ctx.rank == 1 and k == 2:
                    return "left"  # _with_groups closes the group: its peers see it leave
                group.publish(np.full(4, float(k)))
                for peer in reads:
                    assert group.peer_array(peer, np.float64, 4)[0] == k
        except PeerLostError as exc:
            return f"lost {exc.peer}: {exc}"
        return "finished"

    results = _with_groups(3, body)
    assert results[1] == "left"
    assert results[2].startswith("lost 1: ") and "closed its shared-memory group" in results[2]
    assert results[0].startswith("lost 1: ") and "rank 2 saw it first" in results[0]
