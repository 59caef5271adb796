"""``bench scaling --check``: allreduces (the ring, halving-doubling) measured in real processes under the fault
injector, beside the same plans replayed on a profile. Asserts that both sides are there and consistent, never how
fast they are."""

from __future__ import annotations

import pytest

from paratrain.bench.scaling import check_scaling, render_check
from paratrain.sim.machine import LinkCost, MachineProfile

pytestmark = pytest.mark.timeout(120)


def test_check_measures_and_simulates_every_n_and_algorithm() -> None:
    profile = MachineProfile("test", {"ipc": LinkCost(300e-6, 0.3e-9)}, gamma=1e-10, copy=5e-11)
    report = check_scaling(
        profile,
        nbytes=64 << 10,
        workers=[2, 3],
        spec="bandwidth=1Gbit",
        algorithms=("ring", "halving_doubling"),
        iters=2,
        repeat=1,
        timeout=90,
    )
    rows = {(r["workers"], r["scheme"]): r for r in report["rows"]}
    assert set(rows) == {(2, "ring"), (2, "halving_doubling"), (3, "ring"), (3, "halving_doubling")}
    for row in rows.values():
        assert row["measured_s"] > 0 and row["simulated_s"] > 0
        assert row["error"] == pytest.approx(row["simulated_s"] / row["measured_s"] - 1)
    # 64 KiB over 1 Gbit/s: at least the wire time of what the ring sends, 2 (N-1)/N of it
    assert rows[(2, "ring")]["simulated_s"] >= (64 << 10) / 125e6
    assert "median |error|" in render_check(report)
