"""Pure communication plans: which rank sends to and receives from whom, step by step. No I/O.

The runtime executes these plans over a transport, the simulator replays them with a cost model, and the
tests check them against exact tables: one plan, three users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

__all__ = [
    "BarrierRound",
    "Direction",
    "RingStep",
    "TreeStep",
    "binomial_tree_broadcast",
    "binomial_tree_reduce",
    "chain_broadcast",
    "chunk_bounds",
    "dissemination_barrier",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce_scatter",
]


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


# -- chunking -------------------------------------------------------------------------------------------------


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the ``n`` near-equal parts of ``length`` items, as :func:`numpy.array_split` cuts them.

    The first ``length % n`` parts are one item longer; parts may be empty when ``length < n``. Ring plans index
    these parts, and ``reduce_scatter`` gives rank ``r`` part ``r``, so every user of the split agrees with numpy.

    Example:
        >>> chunk_bounds(7, 3)
        [(0, 3), (3, 5), (5, 7)]
    """
    if n < 1 or length < 0:
        raise ValueError(f"cannot split {length} items into {n} parts")
    base, extra = divmod(length, n)
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


# -- ring -----------------------------------------------------------------------------------------------------


class RingStep(NamedTuple):
    """One step of a ring: send chunk ``send_chunk`` to ``send_to`` while receiving ``recv_chunk`` from ``recv_from``.

    A named tuple, so tables in tests and the simulator can be written as plain tuples.
    """

    send_to: int
    send_chunk: int
    recv_from: int
    recv_chunk: int


def _check_rank(rank: int, n: int) -> None:
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"rank {rank} outside 0..{n - 1}")


def ring_reduce_scatter(rank: int, n: int) -> list[RingStep]:
    """Ring reduce-scatter (Patarasuk and Yuan; Baidu's ring allreduce, first half): N - 1 steps, any N.

    The array is cut into N chunks (:func:`chunk_bounds`). In step s rank r sends chunk ``(r - s - 1) mod N`` to
    ``r + 1`` and receives chunk ``(r - s - 2) mod N`` from ``r - 1``, which it reduces into its own copy; the
    chunk it sends in step s + 1 is the one it just reduced, so each chunk travels once round the ring
    collecting one contribution per hop. After the last step rank r holds the fully reduced chunk **r** (not
    ``r + 1`` as in the textbook numbering): that is ``numpy.array_split`` order, so ``reduce_scatter`` returns
    it without a final shuffle.

    Cost (alpha-beta model: a message of m bytes takes alpha + m*beta; the array has n bytes): N - 1 steps
    of alpha + (n/N)*beta each; every rank sends and receives (N - 1)/N of the data, optimal and independent
    of N.

    Example:
        >>> ring_reduce_scatter(0, 3)[0]
        RingStep(send_to=1, send_chunk=2, recv_from=2, recv_chunk=1)
        >>> [tuple(s) for s in ring_reduce_scatter(0, 3)]
        [(1, 2, 2, 1), (1, 1, 2, 0)]
    """
    _check_rank(rank, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    return [RingStep(right, (rank - s - 1) % n, left, (rank - s - 2) % n) for s in range(n - 1)]


def ring_allgather(rank: int, n: int) -> list[RingStep]:
    """Ring allgather: N - 1 steps in which every rank forwards the chunk it received last to its right.

    Rank r starts with chunk r (what :func:`ring_reduce_scatter` leaves it); in step s it sends chunk
    ``(r - s) mod N`` to ``r + 1`` and receives chunk ``(r - s - 1) mod N`` from ``r - 1``.

    Cost (alpha-beta): N - 1 steps of alpha + (n/N)*beta; every rank sends (N - 1)/N of the data.

    Example:
        >>> [tuple(s) for s in ring_allgather(0, 3)]
        [(1, 0, 2, 2), (1, 2, 2, 1)]
    """
    _check_rank(rank, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    return [RingStep(right, (rank - s) % n, left, (rank - s - 1) % n) for s in range(n - 1)]


def ring_allreduce(rank: int, n: int) -> list[RingStep]:
    """Ring allreduce = :func:`ring_reduce_scatter` then :func:`ring_allgather`: 2(N - 1) steps.

    In every step the chunk sent is the chunk received in the step before (``plan[s + 1].send_chunk ==
    plan[s].recv_chunk``), which is what lets the executor forward each segment as soon as it arrives.

    Cost (alpha-beta, n bytes): 2(N - 1)*alpha + 2((N - 1)/N)*n*beta. Each rank sends and receives
    2(N - 1)/N of the data, the bandwidth lower bound for allreduce, so the ring wins for large arrays; its
    2(N - 1) latencies lose to a tree's 2 log2 N for small ones.

    Example:
        >>> [tuple(s) for s in ring_allreduce(1, 2)]
        [(0, 0, 0, 1), (0, 1, 0, 0)]
    """
    return ring_reduce_scatter(rank, n) + ring_allgather(rank, n)


# -- trees ----------------------------------------------------------------------------------------------------

Direction = Literal["send", "recv"]


class TreeStep(NamedTuple):
    """One step of a tree (or chain) exchange: send the buffer to ``peer``, or receive from ``peer``."""

    peer: int
    direction: Direction


def binomial_tree_reduce(rank: int, n: int, root: int = 0) -> list[TreeStep]:
    """Binomial-tree reduce towards ``root``: ceil(log2 N) rounds, any N, any root.

    Ranks are renumbered relative to the root (``v = (rank - root) mod N``). In round k (mask ``2**k``) a rank
    whose bit k is set sends its partial result to ``v - 2**k`` and is done; the others receive from
    ``v + 2**k`` if it exists. Children are received smallest subtree first, which is also the order their
    partial results become ready. A rank's steps are its receives (in round order) and then at most one send.

    Cost (alpha-beta): ceil(log2 N)*(alpha + n*beta) on the critical path; the full array crosses every tree
    edge, so a ring beats it for large arrays.

    Example:
        >>> [tuple(s) for s in binomial_tree_reduce(0, 5)]
        [(1, 'recv'), (2, 'recv'), (4, 'recv')]
        >>> [tuple(s) for s in binomial_tree_reduce(3, 5)]
        [(2, 'send')]
    """
    _check_rank(rank, n)
    _check_rank(root, n)
    v = (rank - root) % n
    steps: list[TreeStep] = []
    mask = 1
    while mask < n:
        if v & mask:
            steps.append(TreeStep((v - mask + root) % n, "send"))
            break
        if v + mask < n:
            steps.append(TreeStep((v + mask + root) % n, "recv"))
        mask <<= 1
    return steps


def binomial_tree_broadcast(rank: int, n: int, root: int = 0) -> list[TreeStep]:
    """Binomial-tree broadcast from ``root``: the mirror image of :func:`binomial_tree_reduce`.

    A rank receives from its parent (``v`` minus its lowest set bit), then sends to its children largest
    subtree first (``v + 2**k`` for k from high to low), so the deepest subtree starts earliest.

    Cost (alpha-beta): ceil(log2 N)*(alpha + n*beta).

    Example:
        >>> [tuple(s) for s in binomial_tree_broadcast(0, 5)]
        [(4, 'send'), (2, 'send'), (1, 'send')]
        >>> [tuple(s) for s in binomial_tree_broadcast(2, 5)]
        [(0, 'recv'), (3, 'send')]
    """
    _check_rank(rank, n)
    _check_rank(root, n)
    v = (rank - root) % n
    steps: list[TreeStep] = []
    if v == 0:
        mask = 1
        while mask < n:
            mask <<= 1
    else:
        mask = v & -v
        steps.append(TreeStep((v - mask + root) % n, "recv"))
    mask >>= 1
    while mask:
        if v + mask < n:
            steps.append(TreeStep((v + mask + root) % n, "send"))
        mask >>= 1
    return steps


def chain_broadcast(rank: int, n: int, root: int = 0) -> list[TreeStep]:
    """A chain ``root -> root + 1 -> ... -> root - 1`` for pipelined broadcast of large arrays.

    Each rank receives from its predecessor and sends to its successor; the executor cuts the array into
    segments and forwards each as soon as it arrives. With S segments the time is (N - 2 + S) segment
    transfers, so for S >> N every link carries the data once, at full bandwidth: about
    n*beta + (N - 2 + S)*alpha against the binomial tree's ceil(log2 N)*(alpha + n*beta).

    Example:
        >>> [tuple(s) for s in chain_broadcast(2, 4, root=1)]
        [(1, 'recv'), (3, 'send')]
    """
    _check_rank(rank, n)
    _check_rank(root, n)
    v = (rank - root) % n
    steps: list[TreeStep] = []
    if v > 0:
        steps.append(TreeStep((rank - 1) % n, "recv"))
    if v < n - 1:
        steps.append(TreeStep((rank + 1) % n, "send"))
    return steps
