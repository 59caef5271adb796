"""The scaling study's exchanges: the textbook costs where there is one, and the symmetric shortcuts exact."""

from __future__ import annotations

import pytest

from paratrain.bench.scaling import exchange_time, render_scaling, run_scaling
from paratrain.gossip.mixing import resolve_mixing
from paratrain.gossip.plan import gossip_plan
from paratrain.sim.machine import LinkCost
from paratrain.sim.replay import Network, replay

LINK = LinkCost(alpha=1e-5, beta=1e-9)
NBYTES = 64 * 1000 * 8  # divisible by every N below


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_is_flat_and_central_is_linear(n: int) -> None:
    ring = exchange_time("ring", n, NBYTES, LINK)
    assert ring == pytest.approx(2 * (n - 1) * (LINK.alpha + NBYTES / n * LINK.beta), rel=1e-9)
    central = exchange_time("central", n, NBYTES, LINK)
    # every worker's gradient into the server's link, and the model back out of it: 2 N n beta, plus latencies
    assert 2 * n * NBYTES * LINK.beta < central < 2 * n * NBYTES * LINK.beta + 8 * LINK.alpha


def test_the_gossip_round_is_the_runtimes_plan_of_the_ring_graph() -> None:
    from paratrain.bench.scaling import ring_gossip_plan

    w, _ = resolve_mixing("ring", 16)
    assert ring_gossip_plan(16, NBYTES).ranks == gossip_plan(w, NBYTES).ranks
    full = replay(gossip_plan(w, NBYTES), Network.uniform(LINK)).time
    assert exchange_time("gossip", 16, NBYTES, LINK) == pytest.approx(full, rel=1e-12)


def test_report_and_table() -> None:
    report = run_scaling(nbytes=NBYTES, link=LINK, workers=[2, 4], schemes=["ring", "tree"])
    assert [(r["scheme"], r["workers"]) for r in report["rows"]] == [("ring", 2), ("tree", 2), ("ring", 4), ("tree", 4)]
    table = render_scaling(report)
    assert table.splitlines()[0].startswith("| N | ring | tree |") and "| 4 |" in table
    with pytest.raises(ValueError, match="unknown scheme"):
        exchange_time("star", 4, NBYTES, LINK)


def test_a_training_step_on_the_described_cluster_shares_no_cores_at_any_n() -> None:
    """One rank per host: the profiling host's core sharing must not slow the full replay (N <= 64) below the
    rank-0 replay above it (it did: 64 workers took longer than 256 with a profile that measured a step alone)."""
    from paratrain.bench.scaling import training_step
    from paratrain.sim.machine import LayerCost, MachineProfile, ModelProfile

    layers = (
        LayerCost("fc1", 2e-3, 4e-3, ("fc1.weight",), (1 << 18,)),
        LayerCost("fc2", 1e-3, 2e-3, ("fc2.weight",), (1 << 16,)),
    )
    shared = ModelProfile("m", 64, layers, optimizer_s=1e-3, concurrency=4, alone_s=4e-3)
    assert shared.cores() is not None  # the profile says 4 processes shared the cores
    profile = MachineProfile("box", {"ipc": LinkCost(1e-4, 1e-9), "injected@4": LinkCost(2e-4, 2e-9)})
    link = LinkCost(alpha=1e-5, beta=1 / 1.25e9)
    steps = {n: training_step(profile, shared, n, link).step_s for n in (4, 16, 64, 65, 256)}
    assert list(steps.values()) == sorted(steps.values())  # more workers, never a shorter step
    assert steps[64] <= steps[65] <= steps[64] * 1.1  # the full replay and the rank-0 replay meet at the switch
    unshared = ModelProfile("m", 64, layers, optimizer_s=1e-3, concurrency=4)
    assert steps[16] == training_step(profile, unshared, 16, link).step_s
