"""Blink's idea for links of different speeds: pack weighted spanning trees over the links that exist. No I/O.

A ring runs at its slowest link. Blink (Wang et al., MLSys 2020) instead treats the links as a graph with
capacities and packs spanning trees into it, each with a rate, so that no link carries more than it can; an
allreduce then sends each tree its share of the array (proportional to its rate), reduced towards the tree's
root and broadcast back (:func:`~.lower_allreduce.trees_into`). Reduce and broadcast use the two directions of a
tree's links, so one packing serves both at once, and the allreduce takes about ``bytes / total rate``.

The best fractional packing is Nash-Williams and Tutte's: its total rate is the minimum, over partitions of the
ranks into ``p >= 2`` parts, of the capacity crossing the parts divided by ``p - 1``. :func:`pack_trees`
approaches it with Garg and Könemann's multiplicative weights (repeatedly the shortest spanning tree under
lengths that grow on loaded links), keeps the heaviest trees, and scales them down until every link is within
its capacity: a pure function of the capacities, so every rank computes the same trees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from paratrain.collectives.plans_allreduce import TreePlace

__all__ = ["PackedTree", "link_capacity", "orient", "pack_trees", "packing_rate"]

#: Capacities: ``(a, b)`` with ``a < b`` -> bytes per second each way. A pair not listed has no link.
Capacity = Mapping[tuple[int, int], float]


class PackedTree(NamedTuple):
    """A spanning tree (edges ``(a, b)``, ``a < b``, sorted) and the bytes per second it carries."""

    rate: float
    edges: tuple[tuple[int, int], ...]


def link_capacity(n: int, rates: Mapping[tuple[int, int], float], default: float) -> dict[tuple[int, int], float]:
    """The capacities of ``n`` ranks: ``rates`` for the pairs with a link of their own (either order), ``default``
    for the others (which share their nodes' links in fact; they count here as if each had it alone).

    Example:
        >>> link_capacity(3, {(1, 0): 2.0}, 5.0)
        {(0, 1): 2.0, (0, 2): 5.0, (1, 2): 5.0}
    """
    capacity = {(a, b): default for a in range(n) for b in range(a + 1, n)}
    for (a, b), rate in rates.items():
        capacity[(min(a, b), max(a, b))] = rate
    return capacity


def _spanning_tree(n: int, order: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """Kruskal's forest over edges taken in ``order``: the spanning tree, or None when the graph is split."""
    root = list(range(n))

    def find(x: int) -> int:
        while root[x] != x:
            root[x] = root[root[x]]
            x = root[x]
        return x

    tree = []
    for a, b in order:
        ra, rb = find(a), find(b)
        if ra != rb:
            root[ra] = rb
            tree.append((a, b))
            if len(tree) == n - 1:
                break
    return tuple(sorted(tree)) if len(tree) == n - 1 or n == 1 else None


def pack_trees(n: int, capacity: Capacity, *, max_trees: int = 6, epsilon: float = 0.1) -> tuple[PackedTree, ...]:
    """Spanning trees over ``n`` ranks with rates that fit ``capacity``, heaviest first (at most ``max_trees``).

    Raises:
        ValueError: the links do not connect every rank, or a capacity is not positive.

    Example:
        >>> even = {(a, b): 1.0 for a in range(4) for b in range(a + 1, 4)}
        >>> round(packing_rate(pack_trees(4, even)), 1)  # Nash-Williams: 6 links / 3 = 2, within epsilon
        2.0
    """
    edges = sorted(capacity)
    if any(not 0 <= a < b < n for a, b in edges) or any(capacity[e] <= 0 for e in edges):
        raise ValueError(f"links must join two ranks of 0..{n - 1} (smaller first) with a positive capacity")
    if n == 1:
        return (PackedTree(math.inf, ()),)
    if _spanning_tree(n, edges) is None:
        raise ValueError(f"the links do not connect all {n} ranks")

    def shortest_any(length: Mapping[tuple[int, int], float]) -> tuple[tuple[int, int], ...]:
        tree = _spanning_tree(n, sorted(edges, key=lambda e: (length[e], e)))
        assert tree is not None
        return tree

    found = _multiplicative_weights(capacity, edges, shortest_any, epsilon)
    kept = [tree for tree, _ in sorted(found.items(), key=lambda item: (-item[1], item[0]))[:max_trees]]
    if len(found) > max_trees:  # the rates again, over the trees kept alone

        def shortest_kept(length: Mapping[tuple[int, int], float]) -> tuple[tuple[int, int], ...]:
            return min(kept, key=lambda tree: (sum(length[e] for e in tree), tree))

        found = _multiplicative_weights(capacity, edges, shortest_kept, epsilon)
    chosen = sorted(((rate, tree) for tree, rate in found.items() if tree in kept), key=lambda x: (-x[0], x[1]))
    load = {e: sum(rate for rate, tree in chosen if e in tree) for e in edges}
    scale = min(capacity[e] / load[e] for e in edges if load[e] > 0)
    return tuple(PackedTree(rate * scale, tree) for rate, tree in chosen)


def _multiplicative_weights(
    capacity: Capacity,
    edges: Sequence[tuple[int, int]],
    shortest: Callable[[Mapping[tuple[int, int], float]], tuple[tuple[int, int], ...]],
    epsilon: float,
) -> dict[tuple[tuple[int, int], ...], float]:
    """Garg and Könemann's packing: the trees ``shortest`` picks under the edge lengths and their (unscaled)
    rates."""
    delta = (1 + epsilon) / ((1 + epsilon) * len(edges)) ** (1 / epsilon)
    length = {e: delta / capacity[e] for e in edges}
    found: dict[tuple[tuple[int, int], ...], float] = {}
    while sum(capacity[e] * length[e] for e in edges) < 1:
        tree = shortest(length)
        rate = min(capacity[e] for e in tree)
        found[tree] = found.get(tree, 0.0) + rate
        for e in tree:
            length[e] *= 1 + epsilon * rate / capacity[e]
    return found


def packing_rate(trees: Sequence[PackedTree]) -> float:
    """The packing's total rate (bytes per second an allreduce over it moves)."""
    return sum(t.rate for t in trees)


def orient(tree: PackedTree, n: int) -> list[TreePlace]:
    """Every rank's place in ``tree`` hung from its centre (the rank whose farthest rank is nearest; the smallest
    such), children in rank order.

    Example:
        >>> [tuple(p) for p in orient(PackedTree(1.0, ((0, 1), (1, 2), (2, 3))), 4)]
        [(1, ()), (None, (0, 2)), (1, (3,)), (2, ())]
    """
    near: list[list[int]] = [[] for _ in range(n)]
    for a, b in tree.edges:
        near[a].append(b)
        near[b].append(a)

    def levels(start: int) -> list[int | None]:
        parent: list[int | None] = [None] * n
        seen, frontier, depth = {start}, [start], 0
        while frontier:
            nxt = []
            for u in frontier:
                for v in sorted(near[u]):
                    if v not in seen:
                        seen.add(v)
                        parent[v] = u
                        nxt.append(v)
            frontier, depth = nxt, depth + 1
        parent.append(depth)  # (the height, for the choice of the root)
        return parent

    best = min(range(n), key=lambda r: (levels(r)[n], r))
    parent = levels(best)[:n]
    return [TreePlace(parent[r], tuple(c for c in range(n) if parent[c] == r)) for r in range(n)]
