"""The chromatic engine at run time: workers execute a :class:`~paratrain.sched.chromatic.ChromaticPlan` over
the transport, one colour at a time, with vertex programs written as whole-colour numpy updates.

Every rank is a worker and owns the vertices the plan gives it. Each keeps a *view*: one value per vertex of
the graph, valid for the vertices it owns and its ghosts. A sweep, for each colour in order:

1. the worker updates its vertices of the colour at once (``program.update(vertices, view)``: every update reads
   the view as it was before the colour began; under edge consistency no vertex of the colour reads another of
   the same colour, so this is what updating them one by one gives);
2. it sends each other worker the new values that worker reads (the plan's sends for the round), and receives
   the values it reads from the others, in rank order, before the next colour.

A worker never waits for more than the values it reads, so there is no barrier between colours; a vertex is
never updated while a neighbour is (the neighbour's value is what it waits for), which :func:`overlaps` checks
on the engine's own log of when each update ran. Before each sweep a program may ask for global sums
(:meth:`VertexProgram.aggregate`, GraphLab's sync): one allreduce, the same number on every worker. Every
message is numpy arrays; every receive has the context's timeout; a dead worker is PeerLostError on its
neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.sched.chromatic import ChromaticPlan
from paratrain.sched.coloring import smallest_free
from paratrain.sched.graph import Graph

__all__ = ["GreedyColor", "PageRank", "Sweeps", "VertexProgram", "overlaps", "run_chromatic", "run_sequential"]


class VertexProgram(Protocol):
    """An update function over a colour's vertices, vectorised."""

    def aggregate(self, owned: np.ndarray, view: np.ndarray) -> np.ndarray:
        """This worker's share of the global sums the next sweep reads (summed over workers), or an empty array."""
        ...

    def update(self, vertices: np.ndarray, view: np.ndarray, sums: np.ndarray) -> np.ndarray:
        """The new values of ``vertices`` (one colour), from ``view`` and this sweep's global ``sums``."""
        ...


@dataclass
class Sweeps:
    """What a worker did.

    Attributes:
        vertices: the vertices it owns.
        values: their values at the end.
        log: ``(colour, start, end)`` of every colour it updated, on the machine's monotonic clock.
        seconds: wall time of each sweep.
        changes: with a tolerance, each sweep's L1 change over the whole graph (the same on every worker).
    """

    vertices: np.ndarray
    values: np.ndarray
    log: list[tuple[int, float, float]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    changes: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class PageRank:
    """PageRank as a vertex program: ``x_v = (1 - d) / n + d (sum over u -> v of x_u / out(u) + D / n)`` with
    ``D`` the mass of the vertices without out-edges (spread evenly, as networkx does), summed before each sweep.
    Its fixed point is networkx's ``pagerank``; updating in colour order (Gauss-Seidel) gets there in fewer
    sweeps than the power iteration.

    Attributes:
        graph: edges ``u -> v`` pass rank from u to v.
        damping: d.
    """

    graph: Graph
    damping: float = 0.85
    _incoming: Graph = field(init=False, repr=False)
    _out: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_incoming", self.graph.reversed())
        object.__setattr__(self, "_out", self.graph.out_degree().astype(np.float64))

    def neighbours(self) -> Graph:
        """What an update reads: its in-neighbours (a subset of the undirected neighbours)."""
        return self._incoming

    def aggregate(self, owned: np.ndarray, view: np.ndarray) -> np.ndarray:
        dangling = owned[self._out[owned] == 0]
        return np.array([view[dangling].sum()])

    def update(self, vertices: np.ndarray, view: np.ndarray, sums: np.ndarray) -> np.ndarray:
        n = self.graph.num_vertices
        indptr, sources = self._incoming.indptr, self._incoming.indices
        share = np.divide(view, self._out, out=np.zeros_like(view), where=self._out > 0)
        counts = indptr[vertices + 1] - indptr[vertices]
        totals = _segment_sums(share[sources[_positions(indptr, vertices, counts)]], counts)
        result: np.ndarray = (1 - self.damping) / n + self.damping * (totals + sums[0] / n)
        return result


@dataclass(frozen=True)
class GreedyColor:
    """Graph colouring as a vertex program, an update for which consistency decides the result: each vertex
    takes the smallest colour none of its neighbours has. Under edge consistency (a chromatic schedule) no two
    neighbours choose at once, so one sweep leaves a proper colouring; with every vertex updated at once
    (vertex consistency: one class) neighbours choose from the same stale values and clash.

    Attributes:
        graph: its undirected adjacency is what an update reads.
    """

    graph: Graph
    _adjacent: Graph = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_adjacent", self.graph.undirected())

    def aggregate(self, owned: np.ndarray, view: np.ndarray) -> np.ndarray:
        return np.zeros(0)

    def update(self, vertices: np.ndarray, view: np.ndarray, sums: np.ndarray) -> np.ndarray:
        picks = [smallest_free(view[self._adjacent.targets(v)].astype(np.int64)) for v in vertices.tolist()]
        return np.array(picks, dtype=np.float64)


def _positions(indptr: np.ndarray, vertices: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Where each of ``vertices``' rows lies in a CSR ``indices`` array, concatenated."""
    firsts = np.cumsum(counts) - counts
    out: np.ndarray = np.repeat(indptr[vertices] - firsts, counts) + np.arange(int(counts.sum()))
    return out


def _segment_sums(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive segments of ``values`` with these lengths (0 for an empty one). Each segment is summed
    on its own, so a vertex's sum does not depend on which other vertices are updated with it."""
    totals = np.zeros(len(counts))
    nonempty = counts > 0
    if values.size:
        totals[nonempty] = np.add.reduceat(values, (np.cumsum(counts) - counts)[nonempty])
    return totals


def run_sequential(
    plan: ChromaticPlan, program: VertexProgram, values: np.ndarray, sweeps: int, *, tol: float | None = None
) -> np.ndarray:
    """One process: each sweep's sums, then every colour in order on the whole graph (the reference); with
    ``tol``, stops after the first sweep that moved the values by less than ``n * tol`` in L1 (as
    :func:`run_chromatic`)."""
    view = np.asarray(values, dtype=np.float64).copy()
    everything = np.arange(len(view))
    for _ in range(sweeps):
        before = view.copy()
        sums = program.aggregate(everything, view)
        for r in plan.rounds:
            members = np.sort(np.concatenate(r.updates))
            view[members] = program.update(members, view, sums)
        if tol is not None and _moved(plan, np.abs(view - before)) < len(view) * tol:
            break
    return view


def _moved(plan: ChromaticPlan, change: np.ndarray) -> float:
    """A sweep's L1 change, summed per worker's vertices and then in rank order (as the engine adds them)."""
    total = 0.0
    for worker in range(plan.workers):
        total += float(change[plan.owner == worker].sum())
    return total


def run_chromatic(
    ctx: Context,
    plan: ChromaticPlan,
    program: VertexProgram,
    values: np.ndarray,
    sweeps: int,
    *,
    tol: float | None = None,
    on_sweep: Callable[[Sweeps], None] | None = None,
) -> Sweeps:
    """This worker's part of ``sweeps`` sweeps of ``plan`` (see the module docstring). Collective: every rank
    calls it with the same plan, program and start ``values``; rank r is worker r. With ``tol``, the sweeps stop
    after the first that moved the values by less than ``n * tol`` in L1 (networkx's ``pagerank`` criterion):
    one allreduce of the workers' changes per sweep, so every worker stops after the same sweep. ``on_sweep`` is
    called after every sweep (progress).

    Raises:
        ConfigError: a plan for another number of workers.
        PeerLostError, CommTimeoutError: a worker died or fell silent.
    """
    if plan.workers != ctx.world_size:
        raise ConfigError(f"the plan is for {plan.workers} workers, the job has {ctx.world_size}")
    me, group = ctx.rank, ctx.world
    transport, timeout = group.transport, ctx.settings.timeout
    owned = np.flatnonzero(plan.owner == me)
    view = np.full(len(plan.owner), np.nan)
    known = np.concatenate([owned, plan.ghosts[me]])
    view[known] = np.asarray(values, dtype=np.float64)[known]
    out = Sweeps(owned, view[owned])
    for _ in range(sweeps):
        began = time.perf_counter()
        before = view[owned].copy()
        local = program.aggregate(owned, view)
        sums = ctx.allreduce(local) if len(local) else local
        base = group.reserve_tags(max(1, len(plan.rounds)))
        for k, r in enumerate(plan.rounds):
            mine = r.updates[me]
            start = time.monotonic()
            if len(mine):
                view[mine] = program.update(mine, view, sums)
            out.log.append((r.color, start, time.monotonic()))
            for (src, dst), vertices in r.sends.items():
                if src == me:
                    transport.send(dst, base - k, [view[vertices]])
            for (src, dst), vertices in r.sends.items():  # in source order (the plan's keys are sorted)
                if dst == me:
                    view[vertices] = np.asarray(transport.recv(src, base - k, timeout=timeout).arrays[0])
        if tol is not None:
            change = np.zeros(ctx.world_size)
            change[me] = np.abs(view[owned] - before).sum()
            out.changes.append(float(ctx.allreduce(change).sum()))  # own slots: the same sum on every rank
        out.seconds.append(time.perf_counter() - began)
        if on_sweep is not None:
            on_sweep(out)
        if tol is not None and out.changes[-1] < len(view) * tol:
            break
    out.values = view[owned]
    return out


def overlaps(graph: Graph, owner: np.ndarray, logs: list[list[tuple[int, float, float]]], colors: np.ndarray) -> int:
    """How many pairs of adjacent vertices were updated at overlapping times, from the workers' logs (each
    colour's interval stands for all of that worker's vertices of the colour): 0 is edge consistency kept. The
    intervals of each (worker, colour) pair are compared once and weighed by the edges between them."""
    intervals: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for worker, log in enumerate(logs):
        for color, start, end in log:
            intervals.setdefault((worker, color), []).append((start, end))
    edges = graph.undirected().edges()
    edges = edges[edges[:, 0] < edges[:, 1]]
    keys = np.stack([owner[edges[:, 0]], colors[edges[:, 0]], owner[edges[:, 1]], colors[edges[:, 1]]], axis=1)
    pairs, counts = np.unique(keys.astype(np.int64), axis=0, return_counts=True)  # edges per (worker, colour) pair
    seen = 0
    for (wu, cu, wv, cv), count in zip(pairs.tolist(), counts.tolist(), strict=True):
        a = intervals.get((wu, cu), [])
        b = intervals.get((wv, cv), [])
        seen += count * sum(1 for s1, e1 in a for s2, e2 in b if s1 < e2 and s2 < e1)
    return seen
