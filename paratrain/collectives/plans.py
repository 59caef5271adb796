"""Pure communication plans: which rank sends to and receives from whom, step by step. No I/O.

The runtime executes these plans over a transport, the simulator replays them with a cost model, and the
tests check them against exact tables: one plan, three users.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BarrierRound", "dissemination_barrier"]


@dataclass(frozen=True, slots=True)
class BarrierRound:
    """One round of a barrier: send a token to ``send_to``, then wait for one from ``recv_from``."""

    send_to: int
    recv_from: int


def dissemination_barrier(rank: int, world_size: int) -> list[BarrierRound]:
    """The dissemination barrier (Hensgen, Finkel and Manber): ceil(log2 N) rounds, any N.

    In round k rank r signals ``(r + 2**k) mod N`` and waits for ``(r - 2**k) mod N``. After round k a rank
    has heard, directly or transitively, from the 2**(k+1) - 1 ranks before it, so after ceil(log2 N) rounds
    from all of them: nobody leaves before everybody arrived. Unlike a tree it needs no root and no second
    (release) phase, so it costs ceil(log2 N) latencies instead of 2 log2 N.

    Example:
        >>> [(r.send_to, r.recv_from) for r in dissemination_barrier(0, 5)]
        [(1, 4), (2, 3), (4, 1)]
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    rounds: list[BarrierRound] = []
    distance = 1
    while distance < world_size:
        rounds.append(BarrierRound((rank + distance) % world_size, (rank - distance) % world_size))
        distance *= 2
    return rounds
