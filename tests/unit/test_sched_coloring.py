"""GraphLab's consistency by colouring: valid colourings on random and real graphs, networkx's colours exactly,
and a chromatic sweep that equals one process's Gauss-Seidel in colour order."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.sched.chromatic import block_partition, chromatic_plan, sequential_order
from paratrain.sched.coloring import CONSISTENCY_MODELS, Coloring, check, color, conflicts
from paratrain.sched.graph import DPKG_STATUS, Graph, debian_dependencies, power_law_graph, random_graph

needs_dpkg = pytest.mark.skipif(not DPKG_STATUS.is_file(), reason="not a Debian system: no dpkg status file")


def _graphs() -> list[tuple[str, Graph]]:
    graphs = [
        ("random", random_graph(300, 6.0, seed=4)),
        ("power-law", power_law_graph(300, 3, seed=5)),
        ("empty", Graph.from_edges(5, [])),
        ("directed", Graph.from_edges(6, [(0, 1), (2, 1), (3, 1), (1, 4), (4, 5)])),
    ]
    if DPKG_STATUS.is_file():
        graphs.append(("debian", debian_dependencies()))
    return graphs


def _networkx(graph: Graph) -> nx.Graph:
    g = nx.Graph()
    g.add_nodes_from(range(graph.num_vertices))
    g.add_edges_from(map(tuple, graph.undirected().edges().tolist()))
    return g


@pytest.mark.parametrize(("name", "graph"), _graphs())
@pytest.mark.parametrize("model", CONSISTENCY_MODELS)
def test_every_colouring_gives_its_guarantee(name: str, graph: Graph, model: str) -> None:
    coloring = color(graph, model)
    check(graph, coloring)
    assert len(conflicts(graph, coloring.colors, model)) == 0
    members = np.sort(np.concatenate(coloring.classes())) if coloring.num_colors else np.zeros(0)
    assert members.tolist() == list(range(graph.num_vertices))
    if model == "vertex":
        assert coloring.num_colors == min(1, graph.num_vertices)


@pytest.mark.parametrize(("name", "graph"), _graphs())
def test_colours_are_networkx_greedy_largest_first_on_the_graph_and_its_square(name: str, graph: Graph) -> None:
    g = _networkx(graph)
    for model, reference in (("edge", g), ("full", nx.power(g, 2))):
        want = nx.greedy_color(reference, strategy="largest_first")
        got = color(graph, model).colors
        assert [want[v] for v in range(graph.num_vertices)] == got.tolist(), model


def test_conflicts_are_found_and_named() -> None:
    """A broken colouring is caught: adjacent vertices sharing a colour (edge), vertices with a common
    neighbour sharing one (full); vertex consistency allows everything."""
    graph = random_graph(100, 5.0, seed=2)
    good = color(graph, "edge")
    u, v = graph.undirected().edges()[0]
    bad = good.colors.copy()
    bad[v] = bad[u]
    assert [u, v] in conflicts(graph, bad, "edge").tolist()
    with pytest.raises(ConfigError, match="break edge consistency"):
        check(graph, Coloring("edge", bad))
    assert len(conflicts(graph, good.colors, "full")) > 0  # a proper colouring is not a distance-2 one
    assert len(conflicts(graph, np.zeros(100, dtype=np.int64), "vertex")) == 0
    with pytest.raises(ConfigError, match="consistency must be one of"):
        color(graph, "sequential")


@needs_dpkg
def test_the_debian_dependency_graph_is_real() -> None:
    """Every installed package once, sorted by name; libc6 is the hub nearly everything depends on; full
    consistency needs more colours than libc6 has dependants (they are all within distance 2 of each other)."""
    graph = debian_dependencies()
    assert list(graph.names) == sorted(set(graph.names)) and graph.num_vertices > 100
    libc = graph.names.index("libc6")
    dependants = graph.reversed().out_degree()
    assert int(np.argmax(dependants)) == libc
    assert color(graph, "full").num_colors > dependants[libc]
    assert color(graph, "edge").num_colors < 20


def test_a_graph_from_edges_drops_duplicates_and_self_loops() -> None:
    graph = Graph.from_edges(4, [(1, 0), (1, 0), (2, 2), (3, 1), (1, 3)])
    assert graph.edges().tolist() == [[1, 0], [1, 3], [3, 1]]
    assert not graph.is_undirected() and graph.undirected().is_undirected()
    with pytest.raises(ConfigError, match="outside"):
        Graph.from_edges(2, [(0, 2)])


def _update(values: np.ndarray, graph: Graph, v: int) -> float:
    """A vertex program that reads its neighbours: half its own value, half their mean."""
    near = graph.targets(v)
    return float(0.5 * values[v] + 0.5 * values[near].mean()) if len(near) else float(values[v])


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_a_chromatic_sweep_equals_gauss_seidel_in_colour_order(workers: int) -> None:
    """Each worker keeps its own view: its vertices and its ghosts, everything else NaN. It updates its vertices
    of each colour and then receives exactly the plan's sends. After 3 sweeps every worker's values equal one
    process's updates in colour order, bit for bit; a missing send would leave a stale or NaN value."""
    graph = power_law_graph(120, 2, seed=7)
    adjacent = graph.undirected()
    coloring = color(graph, "edge")
    plan = chromatic_plan(graph, coloring, block_partition(graph.num_vertices, workers))
    start = np.random.default_rng(0).random(graph.num_vertices)
    reference = start.copy()
    for _ in range(3):
        for v in sequential_order(coloring).tolist():
            reference[v] = _update(reference, adjacent, v)
    views = []
    for w in range(workers):
        view = np.full(graph.num_vertices, np.nan)
        known = np.concatenate([np.flatnonzero(plan.owner == w), plan.ghosts[w]])
        view[known] = start[known]
        views.append(view)
    for _ in range(3):
        for round_ in plan.rounds:
            for w, mine in enumerate(round_.updates):
                for v in mine.tolist():
                    assert plan.owner[v] == w
                    views[w][v] = _update(views[w], adjacent, v)
            for (src, dst), vertices in round_.sends.items():
                views[dst][vertices] = views[src][vertices]
    for w in range(workers):
        mine = plan.owner == w
        assert np.array_equal(views[w][mine], reference[mine])
    assert plan.sent_per_sweep().trace() == 0
    if workers == 1:
        assert plan.sent_per_sweep().sum() == 0 and not plan.ghosts[0].size


def test_the_chromatic_engine_refuses_a_colouring_without_edge_consistency() -> None:
    graph = random_graph(30, 4.0, seed=1)
    with pytest.raises(ConfigError, match="edge-consistent"):
        chromatic_plan(graph, color(graph, "vertex"), block_partition(30, 2))
    with pytest.raises(ConfigError, match="break edge consistency"):
        chromatic_plan(graph, Coloring("edge", np.zeros(30, dtype=np.int64)), block_partition(30, 2))
