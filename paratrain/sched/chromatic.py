"""The chromatic engine's plan: which worker updates which vertices in each colour, and which values it sends.

GraphLab's chromatic engine (Low et al., VLDB'12) partitions the graph's vertices over the workers and runs one
colour class at a time: every worker updates its own vertices of that colour, in parallel with the others, then
the workers exchange the values that changed and that another worker reads (its *ghosts*: vertices it does not
own but that neighbour one it does), and the next colour starts. Under edge consistency (a proper colouring,
:mod:`paratrain.sched.coloring`) no two vertices of a class are adjacent, so a class's updates read nothing
another update of the same class writes, and a sweep computes exactly what one process computes updating the
vertices one by one in colour order (Gauss-Seidel in that order): the engine's tests compare the two.

:func:`chromatic_plan` is pure: the runtime executes its rounds, the tests read them, and a cost model can
replay them (bytes per worker pair per colour). An update reads the vertex's neighbours in the undirected graph
(what edge consistency allows it to read) and writes only its own vertex.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paratrain.errors import ConfigError
from paratrain.sched.coloring import Coloring, check
from paratrain.sched.graph import Graph

__all__ = ["ChromaticPlan", "Round", "block_partition", "chromatic_plan", "sequential_order"]


@dataclass(frozen=True, eq=False)
class Round:
    """One colour of a sweep.

    Attributes:
        color: the colour class.
        updates: per worker, its vertices of this colour, increasing.
        sends: ``(src, dst)`` -> the vertices of this colour that ``src`` owns and ``dst`` reads (its ghosts),
            increasing; only non-empty pairs.
    """

    color: int
    updates: tuple[np.ndarray, ...]
    sends: dict[tuple[int, int], np.ndarray]


@dataclass(frozen=True, eq=False)
class ChromaticPlan:
    """A sweep of the chromatic engine over ``workers`` workers.

    Attributes:
        owner: vertex v's worker.
        ghosts: per worker, the vertices it reads but does not own, increasing.
        rounds: one per colour, in colour order.
    """

    owner: np.ndarray
    ghosts: tuple[np.ndarray, ...]
    rounds: tuple[Round, ...]

    @property
    def workers(self) -> int:
        """How many workers share the graph."""
        return len(self.ghosts)

    def sent_per_sweep(self) -> np.ndarray:
        """``[src, dst]``: vertex values ``src`` sends ``dst`` in a sweep (each value once, after its round)."""
        out = np.zeros((self.workers, self.workers), dtype=np.int64)
        for r in self.rounds:
            for (src, dst), vertices in r.sends.items():
                out[src, dst] += len(vertices)
        return out


def block_partition(n: int, workers: int) -> np.ndarray:
    """Vertices ``0..n-1`` in ``workers`` contiguous blocks whose sizes differ by at most one.

    Example:
        >>> block_partition(7, 3).tolist()
        [0, 0, 0, 1, 1, 2, 2]
    """
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    return np.minimum(np.arange(n, dtype=np.int64) * workers // max(n, 1), workers - 1)


def sequential_order(coloring: Coloring) -> np.ndarray:
    """The one-process order a sweep equals: colour by colour, each class in increasing vertex order."""
    return np.concatenate(coloring.classes()) if coloring.num_colors else np.zeros(0, dtype=np.int64)


def chromatic_plan(graph: Graph, coloring: Coloring, owner: np.ndarray, *, unchecked: bool = False) -> ChromaticPlan:
    """The sweep of ``coloring`` over the workers that ``owner`` assigns (see the module docstring).

    ``unchecked=True`` builds the plan of any colouring (a vertex-consistency one: everything at once), which
    runs updates that read their neighbours without the guarantee they need: how an experiment shows what
    consistency is for (:class:`~paratrain.sched.vertex.GreedyColor` then leaves conflicts).

    Raises:
        ConfigError: a colouring that is not for edge consistency or does not give it on this graph, or an
            owner array of the wrong length.

    Example:
        A path 0 - 1 - 2 - 3 on two workers (0, 1 | 2, 3), coloured 1 0 1 0: in colour 0 worker 0 updates 1
        and worker 1 updates 3, then worker 0 sends 1 (worker 1 reads it from 2); in colour 1, worker 1 sends 2.

        >>> from paratrain.sched.coloring import color
        >>> path = Graph.from_edges(4, [(0, 1), (1, 2), (2, 3)])
        >>> plan = chromatic_plan(path, color(path, "edge"), block_partition(4, 2))
        >>> [[u.tolist() for u in r.updates] for r in plan.rounds]
        [[[1], [3]], [[0], [2]]]
        >>> [{k: v.tolist() for k, v in r.sends.items()} for r in plan.rounds]
        [{(0, 1): [1]}, {(1, 0): [2]}]
    """
    n = graph.num_vertices
    owner = np.asarray(owner, dtype=np.int64)
    if len(owner) != n or (n and owner.min() < 0):
        raise ConfigError(f"owner must give each of the {n} vertices a worker >= 0")
    if not unchecked and coloring.consistency != "edge":
        raise ConfigError(
            f"the chromatic engine runs updates that read their neighbours: it needs an edge-consistent colouring, "
            f"got {coloring.consistency!r}"
        )
    if not unchecked:
        check(graph, coloring)
    workers = int(owner.max()) + 1 if n else 1
    adjacent = graph.undirected()
    edges = adjacent.edges()
    cross = edges[owner[edges[:, 0]] != owner[edges[:, 1]]]  # (v, u): the owner of u reads v
    readers = [set() for _ in range(n)]  # type: list[set[int]]
    for v, u in cross.tolist():
        readers[v].add(int(owner[u]))
    ghosts = tuple(
        np.unique(cross[owner[cross[:, 1]] == w, 0]) if len(cross) else np.zeros(0, dtype=np.int64)
        for w in range(workers)
    )
    rounds = []
    for k, members in enumerate(coloring.classes()):
        updates = tuple(members[owner[members] == w] for w in range(workers))
        sends: dict[tuple[int, int], list[int]] = {}
        for v in members.tolist():
            for dst in sorted(readers[v]):
                sends.setdefault((int(owner[v]), dst), []).append(v)
        rounds.append(Round(k, updates, {pair: np.array(vs, dtype=np.int64) for pair, vs in sorted(sends.items())}))
    return ChromaticPlan(owner, ghosts, tuple(rounds))
