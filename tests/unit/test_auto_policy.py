"""The ``algorithm="auto"`` policies: loopback crossovers by default, the alpha-beta model on a known network."""

from __future__ import annotations

import pytest

from paratrain.collectives.api import default_allreduce_choice, network_allreduce_choice


def test_default_policy_thresholds() -> None:
    assert [default_allreduce_choice(nbytes, 4) for nbytes in (1024, 1 << 20, 1 << 24)] == ["direct", "tree", "ring"]


@pytest.mark.parametrize(
    ("latency", "bandwidth", "nbytes", "world", "expected"),
    [
        # 100 Mbit/s, 2 ms, 4 ranks, 1.2 MB (the digits MLP): direct 4 ms + 288 ms, tree 4 + 4 x 98 ms, ring
        # 4 + 6 x (2 + 24) ms = 160 ms, halving-doubling the ring's bytes in 4 steps instead of 6: 156 ms (the 2x2
        # torus too; the tie goes to the simpler), where the loopback policy picks the tree
        (0.002, 12.5e6, 1_200_000, 4, "halving_doubling"),
        # 1 KiB: one agreement's worth of latency wins
        (0.002, 12.5e6, 1024, 4, "direct"),
        # 10 ms, 1 Gbit/s: latency-bound at 1.2 MB (direct 20 + 29 ms against ring 20 + 74 ms)
        (0.010, 125e6, 1_200_000, 4, "direct"),
        # 16 MiB over 1 Gbit/s: bandwidth-bound; the ring's 2 MiB segments keep its link busier than halving-
        # doubling's (231 ms against 261 ms)
        (0.010, 125e6, 16 << 20, 4, "ring"),
        # no latency, unlimited bandwidth (loopback's): direct is cheapest for 2 ranks at any size
        (0.0, None, 16 << 20, 2, "direct"),
        # 16 ranks, 1 ms, 1 Gbit/s, 250 kB (2 ms a copy): halving-doubling's 8 steps of shrinking messages (15.8
        # ms) beat the tree's 8 of whole ones (28 ms), the torus's 12 steps (19.8 ms) and direct's 15 copies
        (0.001, 125e6, 250_000, 16, "halving_doubling"),
        (0.001, 125e6, 250_000, 1, "direct"),
    ],
)
def test_network_policy_takes_the_cheapest_by_the_alpha_beta_model(
    latency: float, bandwidth: float | None, nbytes: int, world: int, expected: str
) -> None:
    assert network_allreduce_choice(latency, bandwidth)(nbytes, world) == expected
