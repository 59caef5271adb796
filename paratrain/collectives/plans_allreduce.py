"""Step tables of the allreduce schedules beyond the ring and the binomial tree: who talks to whom, no I/O.

- **Recursive halving-doubling** (Rabenseifner; what MPI libraries pick for mid-size messages): a reduce-scatter
  by recursive halving (log2 P steps; in each a rank swaps half of what it still holds with the partner whose
  rank differs in one bit, and reduces the half it keeps), then an allgather by recursive doubling (the same
  pairs in reverse). Every rank moves 2 (P - 1)/P of the array, as in the ring, in 2 log2 P latencies instead of
  2 (P - 1). A world that is not a power of two folds in first: of the first ``2 * (N - P)`` ranks, each even one
  hands its whole array to the odd one after it and sits out until that one hands the result back.
- **2-D torus** (Mikami et al.; Jia et al.): the ranks as a grid of ``rows x cols`` (row i: ranks ``i * cols``
  to ``i * cols + cols - 1``, so block placement keeps a row on one host); a ring reduce-scatter along each row,
  a ring allreduce along each column of the part a rank holds, and a ring allgather along the row. Rings of
  ``cols`` and ``rows`` ranks instead of one of N: 2 (rows + cols - 2) latencies instead of 2 (N - 1).
- **Double binary tree** (Sanders, Speck and Träff; NCCL's trees): two binary trees over the ranks, each rank a
  leaf in one of them when N is even, each half of the array reduced up one tree and broadcast down it,
  segment by segment; each tree's links carry half of the data, so the full-duplex links under both trees are
  busy at once and the latency is logarithmic.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = [
    "HalvingDoubling",
    "PairStep",
    "TreePlace",
    "double_binary_tree",
    "halving_doubling",
    "in_order_tree",
    "torus_shape",
]


class PairStep(NamedTuple):
    """One step of halving-doubling: swap with ``peer``: send the parts ``send`` (a range of part indices,
    ``[start, stop)``), receive the parts ``recv`` (reduced into what this rank holds while halving, copied while
    doubling)."""

    peer: int
    send: tuple[int, int]
    recv: tuple[int, int]


class HalvingDoubling(NamedTuple):
    """One rank's halving-doubling: ``parts`` (P, the power of two the array is cut into), the fold (``("send",
    peer)``: hand the array over and sit out; ``("recv", peer)``: reduce a sitting-out rank's array in first;
    None), the halving steps, the doubling steps; the unfold returns the result to the rank that sat out."""

    parts: int
    fold: tuple[str, int] | None
    halving: tuple[PairStep, ...]
    doubling: tuple[PairStep, ...]


def _check(rank: int, n: int) -> None:
    if n < 1 or not 0 <= rank < n:
        raise ValueError(f"rank {rank} outside 0..{n - 1}")


def halving_doubling(rank: int, n: int) -> HalvingDoubling:
    """Rank ``rank``'s halving-doubling among ``n`` (any n; see the module docstring). Rank v of the P active
    ranks ends the halving holding part v.

    Example:
        >>> h = halving_doubling(0, 4)
        >>> [(s.peer, s.send, s.recv) for s in h.halving]
        [(2, (2, 4), (0, 2)), (1, (1, 2), (0, 1))]
        >>> [(s.peer, s.send, s.recv) for s in h.doubling]
        [(1, (0, 1), (1, 2)), (2, (0, 2), (2, 4))]
        >>> halving_doubling(0, 3).fold, halving_doubling(1, 3).fold
        (('send', 1), ('recv', 0))
    """
    _check(rank, n)
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if rank < 2 * rem and rank % 2 == 0:
        return HalvingDoubling(p, ("send", rank + 1), (), ())
    fold = ("recv", rank - 1) if rank < 2 * rem else None
    me = rank // 2 if rank < 2 * rem else rank - rem

    def real(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    halving: list[PairStep] = []
    lo, hi, mask = 0, p, p >> 1
    while mask:
        mid = (lo + hi) // 2
        upper = bool(me & mask)
        keep, give = ((mid, hi), (lo, mid)) if upper else ((lo, mid), (mid, hi))
        halving.append(PairStep(real(me ^ mask), give, keep))
        lo, hi = keep
        mask >>= 1
    doubling = tuple(PairStep(s.peer, s.recv, s.send) for s in reversed(halving))
    return HalvingDoubling(p, fold, tuple(halving), doubling)


def torus_shape(n: int) -> tuple[int, int]:
    """The grid ``(rows, cols)`` of the 2-D torus: ``rows`` the largest divisor of ``n`` not above its square
    root (a prime ``n`` is one row: the torus is then the ring).

    Example:
        >>> torus_shape(12), torus_shape(16), torus_shape(7)
        ((3, 4), (4, 4), (1, 7))
    """
    if n < 1:
        raise ValueError(f"no grid of {n} ranks")
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return rows, n // rows


class TreePlace(NamedTuple):
    """A rank's place in one tree: its parent (None at the root) and its children, in order."""

    parent: int | None
    children: tuple[int, ...]


def in_order_tree(position: int, n: int) -> tuple[int | None, tuple[int, ...]]:
    """The in-order binary tree over positions ``0..n-1``: ``(parent, children)`` of ``position``.

    With 1-based positions ``q``, the root is the largest power of two ``<= n``; the positions below it form a
    perfect tree, those above it the same construction shifted. A node's height is the number of trailing zero
    bits of ``q``, so the leaves are the odd ``q`` (the even 0-based positions) and the depth is about log2 n.

    Example:
        >>> [in_order_tree(p, 6) for p in range(6)]  # doctest: +NORMALIZE_WHITESPACE
        [(1, ()), (3, (0, 2)), (1, ()), (None, (1, 5)), (5, ()), (3, (4,))]
    """
    if not 0 <= position < n:
        raise ValueError(f"position {position} outside 0..{n - 1}")
    parent: int | None = None
    lo, hi = 1, n  # the 1-based positions of the subtree being searched
    q = position + 1
    while True:
        root = lo - 1 + (1 << ((hi - lo + 1).bit_length() - 1))
        if q == root:
            break
        parent = root
        lo, hi = (lo, root - 1) if q < root else (root + 1, hi)
    children: list[int] = []
    for a, z in ((lo, root - 1), (root + 1, hi)):
        if a <= z:
            children.append(a - 1 + (1 << ((z - a + 1).bit_length() - 1)))
    return (None if parent is None else parent - 1), tuple(c - 1 for c in children)


def double_binary_tree(rank: int, n: int) -> tuple[TreePlace, TreePlace]:
    """``rank``'s place in the two trees: the in-order tree over the ranks, and the same tree over the ranks
    shifted by one (position ``(rank + 1) mod n``). For even ``n`` the first tree's leaves are the even ranks
    and the second's the odd ones, so every rank is an inner node of at most one tree.

    Example:
        >>> double_binary_tree(0, 4)  # a leaf of the first tree, inner in the second
        (TreePlace(parent=1, children=()), TreePlace(parent=2, children=(3, 1)))
    """
    _check(rank, n)
    first = in_order_tree(rank, n)
    parent, children = in_order_tree((rank + 1) % n, n)
    second = (None if parent is None else (parent - 1) % n, tuple((c - 1) % n for c in children))
    return TreePlace(*first), TreePlace(*second)
