"""Graphs for model-parallel scheduling: compressed sparse rows, and real and random graphs to run on.

A :class:`Graph` holds directed edges ``u -> v`` as compressed sparse rows (vertex u's targets are
``indices[indptr[u]:indptr[u + 1]]``, sorted, no duplicates, no self-loops). An undirected graph is one whose
edges come in both directions (:meth:`Graph.undirected`). Consistency models and colourings
(:mod:`paratrain.sched.coloring`) look at the undirected graph: two vertices conflict when an edge joins them
either way. Algorithms such as PageRank follow the directions.

Graphs that need no download:

* :func:`debian_dependencies`: the installed Debian packages of this machine, an edge from each package to every
  installed package it depends on (``Depends`` and ``Pre-Depends``, every installed alternative of ``a | b``, a
  virtual package resolved to the installed packages that provide it). Read from dpkg's status file. A real
  dependency graph with a few hubs of very high in-degree (libc6), which is what makes colouring interesting.
* :func:`random_graph` (Erdos-Renyi G(n, p) with a given mean degree) and :func:`power_law_graph`
  (preferential attachment, Barabasi-Albert), seeded, for tests and scaling.

Pure apart from :func:`debian_dependencies`, which reads one file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paratrain.errors import ConfigError

__all__ = ["DPKG_STATUS", "Graph", "debian_dependencies", "power_law_graph", "random_graph"]

#: Where dpkg keeps what is installed.
DPKG_STATUS = Path("/var/lib/dpkg/status")


@dataclass(frozen=True, eq=False)
class Graph:
    """Directed edges as compressed sparse rows; build one with :meth:`from_edges`.

    Attributes:
        indptr: ``n + 1`` offsets into ``indices``.
        indices: each vertex's targets, sorted.
        names: a name per vertex, or empty.

    Example:
        >>> g = Graph.from_edges(3, [(0, 1), (1, 2), (1, 2), (2, 2)])
        >>> g.num_vertices, g.num_edges, g.targets(1).tolist()
        (3, 2, [2])
        >>> g.undirected().targets(1).tolist(), g.undirected().num_edges
        ([0, 2], 4)
    """

    indptr: np.ndarray
    indices: np.ndarray
    names: tuple[str, ...] = field(default=())

    @staticmethod
    def from_edges(n: int, edges: Iterable[tuple[int, int]] | np.ndarray, names: Sequence[str] = ()) -> Graph:
        """The graph on vertices ``0..n-1`` with these directed edges; duplicates and self-loops are dropped.

        Raises:
            ConfigError: a vertex out of range, or names that do not match ``n``.
        """
        if n < 0:
            raise ConfigError(f"a graph needs n >= 0 vertices, got {n}")
        if names and len(names) != n:
            raise ConfigError(f"{len(names)} names for {n} vertices")
        pairs = np.asarray(list(edges) if not isinstance(edges, np.ndarray) else edges, dtype=np.int64).reshape(-1, 2)
        if pairs.size and (pairs.min() < 0 or pairs.max() >= n):
            raise ConfigError(f"an edge names a vertex outside 0..{n - 1}")
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        pairs = np.unique(pairs, axis=0) if pairs.size else pairs  # sorted by source, then target
        counts = np.bincount(pairs[:, 0], minlength=n) if pairs.size else np.zeros(n, dtype=np.int64)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return Graph(indptr, pairs[:, 1].copy() if pairs.size else np.zeros(0, dtype=np.int64), tuple(names))

    @property
    def num_vertices(self) -> int:
        """n."""
        return len(self.indptr) - 1

    @property
    def num_edges(self) -> int:
        """Directed edges (an undirected edge counts twice)."""
        return len(self.indices)

    def targets(self, v: int) -> np.ndarray:
        """The vertices ``v`` has an edge to, sorted."""
        return self.indices[self.indptr[v] : self.indptr[v + 1]]

    def out_degree(self) -> np.ndarray:
        """Each vertex's number of targets."""
        return np.diff(self.indptr)

    def edges(self) -> np.ndarray:
        """Every edge as a row ``(u, v)``, sorted."""
        sources = np.repeat(np.arange(self.num_vertices, dtype=np.int64), self.out_degree())
        return np.stack([sources, self.indices], axis=1)

    def reversed(self) -> Graph:
        """Every edge turned around (vertex v's targets are the vertices that had an edge to v)."""
        return Graph.from_edges(self.num_vertices, self.edges()[:, ::-1], self.names)

    def undirected(self) -> Graph:
        """Every edge in both directions: what consistency models and colourings look at."""
        e = self.edges()
        return Graph.from_edges(self.num_vertices, np.concatenate([e, e[:, ::-1]]), self.names)

    def is_undirected(self) -> bool:
        """Whether every edge comes with its reverse."""
        e = self.edges()
        flipped = e[:, ::-1]
        return bool(np.array_equal(e, flipped[np.lexsort((flipped[:, 1], flipped[:, 0]))]))


def random_graph(n: int, mean_degree: float, *, seed: int = 0) -> Graph:
    """An undirected Erdos-Renyi graph G(n, p) with p = ``mean_degree`` / (n - 1), seeded.

    Example:
        >>> g = random_graph(200, 6.0, seed=1)
        >>> g.is_undirected(), 4.5 < g.num_edges / 200 < 7.5
        (True, True)
    """
    if n < 1 or mean_degree < 0:
        raise ConfigError(f"random_graph needs n >= 1 and mean_degree >= 0, got {n} and {mean_degree}")
    rng = np.random.default_rng(seed)
    p = min(1.0, mean_degree / max(1, n - 1))
    u, v = np.triu_indices(n, k=1)
    keep = rng.random(len(u)) < p
    e = np.stack([u[keep], v[keep]], axis=1)
    return Graph.from_edges(n, np.concatenate([e, e[:, ::-1]]))


def power_law_graph(n: int, m: int, *, seed: int = 0) -> Graph:
    """An undirected preferential-attachment graph (Barabasi-Albert): each new vertex joins ``m`` distinct
    earlier ones with probability proportional to their degree, seeded. Degrees follow a power law, with hubs.

    Example:
        >>> g = power_law_graph(500, 2, seed=3)
        >>> g.is_undirected(), int(g.out_degree().max()) > 20
        (True, True)
    """
    if n < m + 1 or m < 1:
        raise ConfigError(f"power_law_graph needs m >= 1 and n > m, got n={n}, m={m}")
    rng = np.random.default_rng(seed)
    ends: list[int] = list(range(m))  # every edge's endpoints so far: sampling from it is degree-proportional
    edges: list[tuple[int, int]] = []
    for v in range(m, n):
        chosen: set[int] = set()
        while len(chosen) < m:
            chosen.add(int(ends[rng.integers(len(ends))]))
        for u in sorted(chosen):
            edges += [(u, v), (v, u)]
            ends += [u, v]
    return Graph.from_edges(n, edges)


_FIELD = re.compile(r"^(Package|Status|Depends|Pre-Depends|Provides):\s*(.*)$")


def debian_dependencies(path: str | Path = DPKG_STATUS) -> Graph:
    """This machine's installed Debian packages, an edge from each to every installed package it depends on
    (see the module docstring); vertices named by package, in name order.

    Raises:
        ConfigError: no dpkg status file there (not a Debian system), saying what to use instead.
    """
    status = Path(path)
    if not status.is_file():
        raise ConfigError(
            f"no dpkg status file at {str(status)!r} (not a Debian system?); use random_graph or power_law_graph"
        )
    packages: dict[str, list[str]] = {}
    provides: dict[str, set[str]] = {}
    for block in status.read_text(errors="replace").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            match = _FIELD.match(line)
            if match:
                fields[match.group(1)] = match.group(2)
        name = fields.get("Package")
        if not name or "installed" not in fields.get("Status", "").split():
            continue
        depends = ", ".join(x for x in (fields.get("Pre-Depends"), fields.get("Depends")) if x)
        packages[name] = [alt for group in depends.split(",") for alt in group.split("|") if alt.strip()]
        for virtual in fields.get("Provides", "").split(","):
            if virtual.strip():
                provides.setdefault(_bare(virtual), set()).add(name)
    names = sorted(packages)
    index = {name: i for i, name in enumerate(names)}
    edges = []
    for name, wanted in packages.items():
        for alt in wanted:
            target = _bare(alt)
            for dep in [target] if target in index else sorted(provides.get(target, ())):
                edges.append((index[name], index[dep]))
    return Graph.from_edges(len(names), edges, names)


def _bare(dependency: str) -> str:
    """``"libc6:any (>= 2.34)"`` -> ``"libc6"``."""
    return dependency.strip().split(" ")[0].split("(")[0].split(":")[0]
