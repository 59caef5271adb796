"""What ``paratrain sched`` measures its model-parallel runs against, computed and timed in this one process:
scikit-learn's Lasso (its optimum, and its time to within a gap of it), matrix factorisation's optimum (the shrunk
SVD) or the same CCD++ picks in one process, networkx's PageRank beside a scipy power iteration; and the check of a
chromatic run's log (no adjacent vertices updated at overlapping times)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from paratrain.sched.graph import Graph

__all__ = [
    "LassoAnchor",
    "MFAnchor",
    "PageRankAnchors",
    "lasso_anchor",
    "mf_anchor",
    "overlapping_updates",
    "pagerank_anchors",
]

#: scikit-learn's tolerances tried, loosest first, for its time to a gap: the loosest that reaches it counts.
GAP_TOLERANCES = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-8)


@dataclass(frozen=True, slots=True)
class LassoAnchor:
    """scikit-learn's Lasso on (X, y): ``optimum`` and ``coef`` of a tight fit (tol 1e-10) that took ``seconds``;
    ``to_gap_s``, the time of the loosest tolerance ``to_gap_tol`` whose fit is within the gap of the optimum
    (``seconds`` and None when none is)."""

    optimum: float
    coef: np.ndarray
    seconds: float
    to_gap_s: float
    to_gap_tol: float | None


def lasso_anchor(x: np.ndarray, y: np.ndarray, alpha: float, gap: float) -> LassoAnchor:
    """scikit-learn's Lasso without intercept (the objective :func:`paratrain.sched.lasso.lasso_objective`), timed."""
    from sklearn.linear_model import Lasso

    from paratrain.sched.lasso import lasso_objective

    began = time.perf_counter()
    reference = Lasso(alpha=alpha, fit_intercept=False, tol=1e-10, max_iter=100_000).fit(x, y)
    seconds = time.perf_counter() - began
    optimum = lasso_objective(x, y, reference.coef_, alpha)
    for tol in GAP_TOLERANCES:
        began = time.perf_counter()
        coef = Lasso(alpha=alpha, fit_intercept=False, tol=tol, max_iter=100_000).fit(x, y).coef_
        to_gap_s = time.perf_counter() - began
        if lasso_objective(x, y, coef, alpha) <= optimum * (1 + gap):
            return LassoAnchor(optimum, reference.coef_, seconds, to_gap_s, tol)
    return LassoAnchor(optimum, reference.coef_, seconds, seconds, None)


@dataclass(frozen=True, slots=True)
class MFAnchor:
    """Dense data: the global ``optimum`` (the shrunk SVD's) found in ``seconds``; sparse data (``optimum`` None):
    the time of the same picks in one process."""

    optimum: float | None
    seconds: float


def mf_anchor(train: Any, *, dense: bool, rank: int, lam: float, picks: int, inner: int, seed: int) -> MFAnchor:
    """The anchor of a factorisation of ``train`` (a scipy sparse matrix): the optimum where the data is dense,
    else one process's CCD++ with the same picks (cyclic), timed."""
    from paratrain.sched.mf import ccdpp, svd_optimum

    began = time.perf_counter()
    if dense:
        optimum = svd_optimum(train.toarray(), rank, lam)
        return MFAnchor(optimum, time.perf_counter() - began)
    ccdpp(train, rank, lam, picks=picks, inner=inner, seed=seed)
    return MFAnchor(None, time.perf_counter() - began)


@dataclass(frozen=True, slots=True)
class PageRankAnchors:
    """networkx's PageRank (``networkx``, in ``networkx_s``) and a scipy sparse power iteration (``power`` after
    ``power_steps`` steps in ``scipy_s``; each step's L1 change and time since the start)."""

    networkx: np.ndarray
    networkx_s: float
    power: np.ndarray
    power_steps: int
    power_changes: list[float]
    power_times: list[float]
    scipy_s: float


def pagerank_anchors(graph: Graph) -> PageRankAnchors:
    """Both anchors on ``graph``, damping 0.85, stopping when a step moves the ranks by < n * 1e-10 in L1."""
    import networkx as nx
    import scipy.sparse as sp

    n = graph.num_vertices
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(map(tuple, graph.edges().tolist()))
    began = time.perf_counter()
    ranks = nx.pagerank(g, alpha=0.85, tol=1e-10, max_iter=1000)
    networkx_s = time.perf_counter() - began
    want = np.array([ranks[v] for v in range(n)])
    edges = graph.edges()
    out_degree = graph.out_degree().astype(np.float64)
    matrix = sp.csr_matrix((1.0 / out_degree[edges[:, 0]], (edges[:, 1], edges[:, 0])), shape=(n, n))
    began = time.perf_counter()
    power, sweeps_power, power_changes, power_times = np.full(n, 1.0 / n), 0, [], []
    while True:
        sweeps_power += 1
        nxt = 0.15 / n + 0.85 * (matrix @ power + power[out_degree == 0].sum() / n)
        power_changes.append(float(np.abs(nxt - power).sum()))
        power_times.append(time.perf_counter() - began)
        done = power_changes[-1] < n * 1e-10 or sweeps_power >= 1000
        power = nxt
        if done:
            break
    scipy_s = time.perf_counter() - began
    return PageRankAnchors(want, networkx_s, power, sweeps_power, power_changes, power_times, scipy_s)


def overlapping_updates(graph: Graph, workers: int, logs: list[list[Any]]) -> int:
    """How often the chromatic run whose workers logged ``logs`` updated adjacent vertices at overlapping times
    (:func:`paratrain.sched.vertex.overlaps`, on the edge-consistent colouring and plan the run used)."""
    from paratrain.sched.chromatic import block_partition, chromatic_plan
    from paratrain.sched.coloring import color
    from paratrain.sched.vertex import overlaps

    coloring = color(graph, "edge")
    plan = chromatic_plan(graph, coloring, block_partition(graph.num_vertices, workers))
    return overlaps(graph, plan.owner, [[tuple(e) for e in log] for log in logs], coloring.colors)
