"""GraphLab's consistency models enforced by colouring: which vertices may update at the same time.

An update function on vertex v reads and writes some of the graph around v. GraphLab (Low et al., VLDB'12)
names three guarantees, and its chromatic engine gives each by running one colour class at a time, every
vertex of a class in parallel, with a barrier (and the exchange of changed values) between classes:

* ``vertex``: an update touches only its own vertex. Any two vertices may run at once: one class.
* ``edge``: an update writes its vertex and reads (or writes) its adjacent edges and neighbours. No two
  adjacent vertices may run at once: a proper colouring (distance 1).
* ``full``: an update also writes its neighbours. No two vertices within distance 2 may run at once (two
  vertices with a common neighbour would both write it): a distance-2 colouring.

Adjacency is the undirected graph's (an edge either way conflicts). :func:`color` is greedy in the
``largest_first`` order (the number of vertices it conflicts with, descending, ties by vertex number), each
vertex taking the smallest colour no conflicting vertex has: exactly networkx's
``greedy_color(strategy="largest_first")`` on the graph (``edge``) or on its square (``full``), which the tests
check colour for colour. :func:`conflicts` finds every pair that breaks the guarantee, so a colouring, or a
log of which vertices really ran at once, can be checked rather than trusted.

Pure: a :class:`Coloring` is data, the same for the engine that runs it, the simulator and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from paratrain.errors import ConfigError
from paratrain.sched.graph import Graph

__all__ = ["CONSISTENCY_MODELS", "Coloring", "Consistency", "check", "color", "conflicts", "smallest_free"]

Consistency = Literal["vertex", "edge", "full"]
#: The models, weakest first.
CONSISTENCY_MODELS: tuple[str, ...] = get_args(Consistency)


@dataclass(frozen=True, eq=False)
class Coloring:
    """A colour per vertex for a consistency model.

    Attributes:
        consistency: the model it was made for.
        colors: vertex v's colour, 0 .. ``num_colors - 1``.

    Example:
        >>> c = Coloring("edge", np.array([0, 1, 0]))
        >>> c.num_colors, [k.tolist() for k in c.classes()]
        (2, [[0, 2], [1]])
    """

    consistency: str
    colors: np.ndarray

    @property
    def num_colors(self) -> int:
        """How many classes (rounds of the chromatic engine per sweep)."""
        return int(self.colors.max()) + 1 if len(self.colors) else 0

    def classes(self) -> list[np.ndarray]:
        """The vertices of each colour, in increasing order: what runs together."""
        order = np.argsort(self.colors, kind="stable")
        bounds = np.searchsorted(self.colors[order], np.arange(self.num_colors + 1))
        return [order[bounds[k] : bounds[k + 1]] for k in range(self.num_colors)]


def _model(consistency: str) -> str:
    if consistency not in CONSISTENCY_MODELS:
        raise ConfigError(f"consistency must be one of {', '.join(CONSISTENCY_MODELS)}, got {consistency!r}")
    return consistency


def largest_first(graph: Graph, distance: int = 1) -> np.ndarray:
    """Vertices by how many others lie within ``distance`` (1: the undirected degree; 2: the degree in the
    square graph, which a distance-2 colouring colours), largest first, ties by vertex number: networkx's
    ``largest_first`` on the graph or its square."""
    adjacent = graph.undirected()
    if distance == 1:
        degree = adjacent.out_degree()
    else:
        degree = np.array([len(_reach(adjacent, v, distance)) for v in range(graph.num_vertices)], dtype=np.int64)
    return np.argsort(-degree, kind="stable")


def _reach(adjacent: Graph, v: int, distance: int) -> np.ndarray:
    """The vertices within ``distance`` (1 or 2) of ``v``, ``v`` excluded."""
    near = adjacent.targets(v)
    if distance == 1 or not len(near):
        return near
    around = np.concatenate([near, *(adjacent.targets(int(u)) for u in near)])
    return np.unique(around[around != v])


def smallest_free(taken: np.ndarray) -> int:
    """The smallest colour >= 0 not in ``taken`` (entries < 0 mean "none yet"): the greedy choice.

    Example:
        >>> smallest_free(np.array([0, 1, 3, -1])), smallest_free(np.array([], dtype=np.int64))
        (2, 0)
    """
    used = np.zeros(len(taken) + 1, dtype=bool)  # the smallest free colour is at most the number taken
    taken = np.asarray(taken, dtype=np.int64)
    used[taken[(taken >= 0) & (taken <= len(taken))]] = True
    return int(np.argmin(used))


def color(graph: Graph, consistency: str = "edge", *, order: np.ndarray | None = None) -> Coloring:
    """A greedy colouring of ``graph`` that gives ``consistency`` (see the module docstring).

    Args:
        graph: directed or not; adjacency is the undirected graph's.
        consistency: ``"vertex"``, ``"edge"`` or ``"full"``.
        order: the order vertices take their colour in (default :func:`largest_first`).

    Raises:
        ConfigError: an unknown model, or an order that is not a permutation of the vertices.

    Example:
        A path a - b - c - d: edge consistency alternates two colours, full keeps any two within distance 2
        apart (three colours), vertex consistency runs everything at once.

        >>> path = Graph.from_edges(4, [(0, 1), (1, 2), (2, 3)])
        >>> [color(path, m).colors.tolist() for m in ("edge", "full", "vertex")]
        [[1, 0, 1, 0], [2, 0, 1, 2], [0, 0, 0, 0]]
    """
    model, n = _model(consistency), graph.num_vertices
    if model == "vertex":
        return Coloring(model, np.zeros(n, dtype=np.int64))
    distance = 1 if model == "edge" else 2
    sequence = largest_first(graph, distance) if order is None else np.asarray(order, dtype=np.int64)
    if sorted(sequence.tolist()) != list(range(n)):
        raise ConfigError(f"order must list each of the {n} vertices once")
    adjacent = graph.undirected()
    colors = np.full(n, -1, dtype=np.int64)
    for v in sequence.tolist():
        colors[v] = smallest_free(colors[_reach(adjacent, v, distance)])
    return Coloring(model, colors)


def conflicts(graph: Graph, together: np.ndarray, consistency: str) -> np.ndarray:
    """Every pair ``(u, v)``, u < v, that ran together (the same value in ``together``: a colour, or a round
    of a log) although ``consistency`` forbids it: adjacent for ``edge``, within distance 2 for ``full``; never
    for ``vertex``. Sorted rows; empty when the guarantee holds.

    Example:
        >>> path = Graph.from_edges(4, [(0, 1), (1, 2), (2, 3)])
        >>> conflicts(path, np.array([1, 0, 1, 0]), "full").tolist()
        [[0, 2], [1, 3]]
    """
    model = _model(consistency)
    if model == "vertex":
        return np.zeros((0, 2), dtype=np.int64)
    adjacent = graph.undirected()
    distance = 1 if model == "edge" else 2
    found = [(v, int(u)) for v in range(graph.num_vertices) for u in _reach(adjacent, v, distance) if u > v]
    pairs = np.array(found, dtype=np.int64).reshape(-1, 2)
    same: np.ndarray = pairs[together[pairs[:, 0]] == together[pairs[:, 1]]]
    return same


def check(graph: Graph, coloring: Coloring) -> None:
    """Raises ConfigError naming the first conflicts if ``coloring`` does not give its model's guarantee."""
    bad = conflicts(graph, coloring.colors, coloring.consistency)
    if len(bad):
        raise ConfigError(
            f"{len(bad)} pairs break {coloring.consistency} consistency, e.g. {bad[:3].tolist()} share a colour"
        )
