"""The chromatic engine at run time: PageRank by colours over workers equals one process's colour-order sweep
and networkx's pagerank, and the engine's own log shows no two adjacent vertices updated at once."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.sched.chromatic import block_partition, chromatic_plan
from paratrain.sched.coloring import color, conflicts
from paratrain.sched.graph import DPKG_STATUS, Graph, debian_dependencies, power_law_graph
from paratrain.sched.vertex import GreedyColor, PageRank, Sweeps, overlaps, run_chromatic, run_sequential
from paratrain.testing import run_ranks


def _graph() -> Graph:
    """The machine's Debian dependency graph where there is one (a real graph), else a power-law one."""
    if DPKG_STATUS.is_file():
        return debian_dependencies()
    edges = power_law_graph(600, 2, seed=1).edges()
    return Graph.from_edges(600, edges[edges[:, 0] < edges[:, 1]])  # directed: towards the later vertex


def _networkx_pagerank(graph: Graph) -> np.ndarray:
    g = nx.DiGraph()
    g.add_nodes_from(range(graph.num_vertices))
    g.add_edges_from(map(tuple, graph.edges().tolist()))
    ranks = nx.pagerank(g, alpha=0.85, tol=1e-15, max_iter=10_000)
    return np.array([ranks[v] for v in range(graph.num_vertices)])


@pytest.mark.parametrize(("workers", "transport"), [(1, "inproc"), (3, "inproc"), (2, "zmq")])
def test_pagerank_by_colours_equals_one_process_and_networkx(workers: int, transport: str) -> None:
    graph = _graph()
    n = graph.num_vertices
    program = PageRank(graph)
    coloring = color(graph, "edge")
    plan = chromatic_plan(graph, coloring, block_partition(n, workers))
    start = np.full(n, 1.0 / n)

    def rank(ctx: Context) -> Sweeps:
        return run_chromatic(ctx, plan, program, start, 120)

    parts = run_ranks(workers, rank, transport=transport, timeout=60)
    got = np.zeros(n)
    for part in parts:
        got[part.vertices] = part.values
    # the same updates in the same order: equal to rounding (the dangling mass is one allreduce, summed apart)
    np.testing.assert_allclose(got, run_sequential(plan, program, start, 120), rtol=0, atol=1e-15)
    np.testing.assert_allclose(got, _networkx_pagerank(graph), rtol=0, atol=1e-6)
    assert got.sum() == pytest.approx(1.0)
    assert overlaps(graph, plan.owner, [p.log for p in parts], coloring.colors) == 0
    assert all(len(p.seconds) == 120 for p in parts)


def test_with_a_tolerance_every_worker_stops_after_the_same_sweep_as_one_process() -> None:
    """networkx's criterion (L1 change below n * tol): the engine stops after the sweep the reference stops
    after, on every worker, with networkx's answer; far fewer sweeps than the cap."""
    graph = _graph()
    n = graph.num_vertices
    plan = chromatic_plan(graph, color(graph, "edge"), block_partition(n, 3))
    start = np.full(n, 1.0 / n)
    parts = run_ranks(3, lambda ctx: run_chromatic(ctx, plan, PageRank(graph), start, 500, tol=1e-10), timeout=60)
    swept = {len(p.seconds) for p in parts}
    assert len(swept) == 1 and 5 < swept.pop() < 500
    got = np.zeros(n)
    for part in parts:
        got[part.vertices] = part.values
    want = run_sequential(plan, PageRank(graph), start, 500, tol=1e-10)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    np.testing.assert_allclose(got, _networkx_pagerank(graph), rtol=0, atol=1e-6)
    k = len(parts[0].seconds)  # the reference ran exactly as many sweeps: k, not k - 1
    assert np.array_equal(run_sequential(plan, PageRank(graph), start, k), want)
    assert not np.array_equal(run_sequential(plan, PageRank(graph), start, k - 1), want)


def test_the_overlap_check_finds_adjacent_updates_that_ran_together() -> None:
    """Two workers' logs where vertex 0's colour (worker 0) and its neighbour 1's colour (worker 1) ran at
    overlapping times: one pair; run apart: none."""
    path = Graph.from_edges(3, [(0, 1), (1, 2)])
    owner, colors = np.array([0, 1, 1]), np.array([0, 1, 0])
    assert overlaps(path, owner, [[(0, 0.0, 2.0)], [(1, 1.0, 3.0), (0, 3.0, 4.0)]], colors) == 1
    assert overlaps(path, owner, [[(0, 0.0, 1.0)], [(1, 1.0, 3.0), (0, 3.0, 4.0)]], colors) == 0


def test_a_plan_for_another_job_size_is_refused() -> None:
    graph = power_law_graph(40, 2, seed=0)
    plan = chromatic_plan(graph, color(graph, "edge"), block_partition(40, 3))
    with pytest.raises(ConfigError, match="for 3 workers"):
        run_ranks(2, lambda ctx: run_chromatic(ctx, plan, PageRank(graph), np.ones(40), 1), timeout=20)


@pytest.mark.parametrize("workers", [1, 3])
def test_greedy_colouring_is_proper_only_under_edge_consistency(workers: int) -> None:
    """Each vertex takes the smallest colour its neighbours do not have. Scheduled by an edge-consistent
    colouring, one sweep leaves a proper colouring (the same as one process in colour order); with every vertex
    at once (a vertex-consistency plan, unchecked) all start from colour 0, all take 1, and every edge clashes,
    which the engine's log also shows as adjacent updates that overlapped."""
    graph = power_law_graph(200, 3, seed=2)
    program, start = GreedyColor(graph), np.zeros(200)

    def sweep(plan: object) -> tuple[np.ndarray, list[Sweeps]]:
        parts = run_ranks(workers, lambda ctx: run_chromatic(ctx, plan, program, start, 1), timeout=60)  # type: ignore[arg-type]
        got = np.zeros(200)
        for part in parts:
            got[part.vertices] = part.values
        return got, parts

    scheduled = chromatic_plan(graph, color(graph, "edge"), block_partition(200, workers))
    proper, parts = sweep(scheduled)
    assert len(conflicts(graph, proper.astype(np.int64), "edge")) == 0
    np.testing.assert_array_equal(proper, run_sequential(scheduled, program, start, 1))
    at_once = color(graph, "vertex")
    loose = chromatic_plan(graph, at_once, block_partition(200, workers), unchecked=True)
    clashing, parts = sweep(loose)
    edges = graph.undirected().num_edges // 2
    assert len(conflicts(graph, clashing.astype(np.int64), "edge")) == edges
    assert overlaps(graph, loose.owner, [p.log for p in parts], at_once.colors) > 0
