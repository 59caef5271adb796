"""A gossip round's plan against exact tables, and against the traffic the mixing module predicts."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.gossip.mixing import metropolis_hastings, neighbors, per_node_traffic, resolve_mixing
from paratrain.gossip.plan import round_plan

# (topology, ranks, bytes per rank) -> every transfer of one round, (src, dst, nbytes)
TABLES = [
    (
        "ring",
        4,
        100,
        [(0, 1, 100), (0, 3, 100), (1, 0, 100), (1, 2, 100), (2, 1, 100), (2, 3, 100), (3, 0, 100), (3, 2, 100)],
    ),
    ("ring", 2, 8, [(0, 1, 8), (1, 0, 8)]),
    ("complete", 3, 0, [(0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 2, 0), (2, 0, 0), (2, 1, 0)]),
    ("ring", 1, 64, []),
]


@pytest.mark.parametrize(("topology", "n", "nbytes", "expected"), TABLES)
def test_round_plan_tables(topology: str, n: int, nbytes: int, expected: list[tuple[int, int, int]]) -> None:
    assert round_plan(resolve_mixing(topology, n)[0], nbytes) == expected


def test_a_path_sends_only_along_its_edges() -> None:
    assert round_plan(metropolis_hastings(3, [(0, 1), (1, 2)]), 8) == [(0, 1, 8), (1, 0, 8), (1, 2, 8), (2, 1, 8)]


@pytest.mark.parametrize("topology", ["ring", "torus", "exponential", "complete"])
def test_plan_agrees_with_neighbors_and_traffic(topology: str) -> None:
    w = resolve_mixing(topology, 8)[0]
    plan = round_plan(w, 1000)
    for node in per_node_traffic(w, 1000):
        sends = [(dst, b) for src, dst, b in plan if src == node.rank]
        receives = [(src, b) for src, dst, b in plan if dst == node.rank]
        assert [dst for dst, _ in sends] == [peer for peer, _ in neighbors(w, node.rank)]  # what the exchange posts
        assert sorted(src for src, _ in receives) == [dst for dst, _ in sends]  # symmetric: receives from them
        assert sum(b for _, b in sends) == node.bytes_sent and sum(b for _, b in receives) == node.bytes_received


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="nbytes"):
        round_plan(resolve_mixing("ring", 3)[0], -1)
    with pytest.raises(ConfigError):
        round_plan([[0.5, 0.4], [0.5, 0.6]], 8)  # not symmetric
