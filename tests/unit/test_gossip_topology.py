"""Gossip graphs and mixing matrices against exact tables, closed forms and the consensus rate they predict."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from paratrain.errors import ConfigError
from paratrain.gossip.mixing import (
    metropolis_hastings,
    neighbors,
    per_node_traffic,
    resolve_mixing,
    spectral_gap,
    validate_mixing,
)
from paratrain.gossip.topology import (
    build_topology,
    complete,
    exponential,
    load_edges,
    resolve_topology,
    ring,
    torus,
    torus_shape,
    validate_edges,
)

# -- edge tables -----------------------------------------------------------------------------------------------


def test_ring_tables() -> None:
    assert ring(1) == []
    assert ring(2) == [(0, 1)]
    assert ring(3) == [(0, 1), (0, 2), (1, 2)]
    assert ring(5) == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]


def test_torus_shapes_and_tables() -> None:
    assert [torus_shape(n) for n in (1, 2, 4, 6, 7, 9, 12, 16)] == [
        (1, 1),
        (1, 2),
        (2, 2),
        (2, 3),
        (1, 7),
        (3, 3),
        (3, 4),
        (4, 4),
    ]
    assert torus(4) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert torus(6) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 4), (2, 5), (3, 4), (3, 5), (4, 5)]
    assert torus(7) == ring(7)  # prime: one row
    edges9 = torus(9)
    assert len(edges9) == 18  # 3 x 3 with wraparound: every rank has degree 4
    degrees = np.bincount(np.array(edges9).ravel(), minlength=9)
    assert degrees.tolist() == [4] * 9
    assert (0, 2) in edges9 and (0, 6) in edges9  # the wraparound edges of rank 0


def test_exponential_tables() -> None:
    assert exponential(2) == [(0, 1)]
    assert exponential(4) == complete(4)  # +-1, +-2 reach everyone
    edges8 = exponential(8)
    assert [v for u, v in edges8 if u == 0] == [1, 2, 4, 6, 7]
    assert len(edges8) == 20
    edges16 = exponential(16)
    assert sorted({(v - u) % 16 for u, v in edges16} | {(u - v) % 16 for u, v in edges16}) == [
        1,
        2,
        4,
        8,
        12,
        14,
        15,
    ]


def test_complete_and_by_name() -> None:
    assert complete(3) == [(0, 1), (0, 2), (1, 2)]
    assert len(complete(6)) == 15
    assert build_topology(" Ring ", 4) == ring(4)
    with pytest.raises(ConfigError, match="unknown topology 'star'"):
        build_topology("star", 4)


# -- validation and user graphs --------------------------------------------------------------------------------


def test_validate_edges_errors() -> None:
    assert validate_edges(3, [(1, 0), [0, 1], (2, 1)]) == [(0, 1), (1, 2)]
    with pytest.raises(ConfigError, match="not connected: rank\\(s\\) 2, 3"):
        validate_edges(4, [(0, 1)])
    with pytest.raises(ConfigError, match="self-loop"):
        validate_edges(3, [(0, 1), (1, 2), (2, 2)])
    with pytest.raises(ConfigError, match=r"outside 0\.\.2"):
        validate_edges(3, [(0, 1), (1, 3)])
    with pytest.raises(ConfigError, match=r"outside 0\.\.2"):
        validate_edges(3, [(-1, 1), (1, 2)])
    with pytest.raises(ConfigError, match="pair of integer ranks"):
        validate_edges(3, [(0, 1, 2)])
    with pytest.raises(ConfigError, match="pair of integer ranks"):
        validate_edges(3, [(0, 1.5)])
    with pytest.raises(ConfigError, match=">= 1"):
        validate_edges(0, [])


def test_load_edges_text_json_and_duck_typed(tmp_path: Path) -> None:
    text = tmp_path / "g.txt"
    text.write_text("# a path\n0 1\n\n1 2  # middle\n2,3\n")
    assert load_edges(text) == [(0, 1), (1, 2), (2, 3)]
    js = tmp_path / "g.json"
    js.write_text(json.dumps([[0, 1], [2, 1]]))
    assert load_edges(str(js)) == [(0, 1), (1, 2)]

    class Graph:  # what networkx offers, without needing networkx
        def edges(self) -> list[tuple[int, int]]:
            return [(0, 1), (1, 2), (0, 2)]

    assert load_edges(Graph()) == complete(3)
    assert resolve_topology(str(text), 4) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ConfigError, match="not connected"):
        resolve_topology(str(text), 5)


def test_load_edges_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1\n1 x\n")
    with pytest.raises(ConfigError, match="line 2: expected two integer ranks"):
        load_edges(bad)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("[[0, 1], [1")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_edges(bad_json)
    with pytest.raises(ConfigError, match="cannot read"):
        load_edges(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="neither one of ring"):
        resolve_topology(str(tmp_path / "missing.txt"), 4)


# -- mixing matrices -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(3, 13))
def test_ring_metropolis_hastings_and_closed_form_gap(n: int) -> None:
    w = metropolis_hastings(n, ring(n))
    validate_mixing(w)
    for i in range(n):
        assert w[i, i] == pytest.approx(1 / 3, abs=1e-15)
        assert neighbors(w, i) == sorted([((i - 1) % n, 1 / 3), ((i + 1) % n, 1 / 3)])
    assert abs(spectral_gap(w) - (1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / n)))) < 1e-12


def test_metropolis_hastings_uneven_degrees() -> None:
    # a star: centre degree 3, leaves degree 1 -> every edge weight 1/4, centre keeps 1/4, leaves 3/4
    w = metropolis_hastings(4, [(0, 1), (0, 2), (0, 3)])
    validate_mixing(w)
    assert w[0].tolist() == [0.25, 0.25, 0.25, 0.25]
    assert w[1].tolist() == [0.25, 0.75, 0.0, 0.0]
    assert neighbors(w, 1) == [(0, 0.25)]


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_complete_graph_averages_in_one_step(n: int) -> None:
    w = metropolis_hastings(n, complete(n))
    assert np.allclose(w, 1.0 / n, atol=1e-15)
    assert spectral_gap(w) == pytest.approx(1.0, abs=1e-12)


def test_gap_orders_topologies() -> None:
    gaps = {name: spectral_gap(metropolis_hastings(16, build_topology(name, 16))) for name in ("ring", "torus")}
    gaps["exponential"] = spectral_gap(metropolis_hastings(16, exponential(16)))
    assert 0 < gaps["ring"] < gaps["torus"] < gaps["exponential"] < 1


def test_validate_mixing_rejects() -> None:
    with pytest.raises(ConfigError, match="not symmetric: W\\[0,1\\]"):
        validate_mixing([[0.5, 0.5], [0.4, 0.6]])
    with pytest.raises(ConfigError, match=r"row 0 sums to 0\.9"):
        validate_mixing([[0.5, 0.4], [0.4, 0.6]])
    with pytest.raises(ConfigError, match="negative weight"):
        validate_mixing([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(ConfigError, match="square"):
        validate_mixing([[1.0, 0.0]])
    with pytest.raises(ConfigError, match="NaN"):
        validate_mixing([[float("nan")]])
    with pytest.raises(ConfigError, match="not symmetric"):
        spectral_gap([[0.5, 0.5], [0.4, 0.6]])
    with pytest.raises(ConfigError, match=r"outside 0\.\.1"):
        neighbors(np.eye(2), 2)


def test_per_node_traffic() -> None:
    w = metropolis_hastings(4, [(0, 1), (0, 2), (0, 3)])
    traffic = per_node_traffic(w, 1000)
    assert [(t.rank, t.neighbors, t.bytes_sent, t.bytes_received) for t in traffic] == [
        (0, 3, 3000, 3000),
        (1, 1, 1000, 1000),
        (2, 1, 1000, 1000),
        (3, 1, 1000, 1000),
    ]
    with pytest.raises(ConfigError, match="nbytes"):
        per_node_traffic(w, -1)


# -- consensus at the predicted rate ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ring", "torus", "exponential"])
def test_gossip_converges_at_the_spectral_gap_rate(name: str) -> None:
    n, steps = 12, 40
    w = metropolis_hastings(n, build_topology(name, n))
    rate = 1 - spectral_gap(w)
    x0 = np.random.default_rng(7).normal(size=(n, 3))  # three independent vectors, one per column
    mean = x0.mean(axis=0)
    x = x0.copy()
    dist0 = np.linalg.norm(x0 - mean)
    for t in range(1, steps + 1):
        x = w @ x
        assert np.allclose(x.mean(axis=0), mean, atol=1e-12)  # doubly stochastic: the mean never moves
        assert np.linalg.norm(x - mean) <= rate**t * dist0 * (1 + 1e-9) + 1e-12

    # the slowest mode meets the bound: start on the eigenvector of the second largest |eigenvalue|
    values, vectors = np.linalg.eigh(w)
    order = np.argsort(-np.abs(values))
    slow = vectors[:, order[1]]
    assert abs(abs(values[order[1]]) - rate) < 1e-12
    y = slow.copy()
    for _ in range(10):
        y = w @ y
    assert np.linalg.norm(y) == pytest.approx(rate**10 * np.linalg.norm(slow), rel=1e-9)


def test_resolve_mixing_names_graphs_and_matrices() -> None:
    w, edges = resolve_mixing("ring", 5)
    assert edges == ring(5)
    np.testing.assert_array_equal(w, metropolis_hastings(5, ring(5)))
    given = np.array([[0.6, 0.4, 0.0], [0.4, 0.2, 0.4], [0.0, 0.4, 0.6]])
    w, edges = resolve_mixing(given, 3)
    assert edges == [(0, 1), (1, 2)] and w is not given
    np.testing.assert_array_equal(w, given)
    w, edges = resolve_mixing([[1, 0], (1, 2)], 3)  # lists are edges
    assert edges == [(0, 1), (1, 2)]
    np.testing.assert_array_equal(w, metropolis_hastings(3, edges))
    with pytest.raises(ConfigError, match="3 x 3 but the job has 4 workers"):
        resolve_mixing(given, 4)
    with pytest.raises(ConfigError, match="not doubly stochastic"):
        resolve_mixing(given * 0.5, 3)
