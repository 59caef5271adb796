"""``paratrain bench chaos`` end to end on two drawn schedules (seed 4: allreduce killed at step 4 and restarted
cold; sfb's two workers killed at steps 3 and 11, each restarted): each finishes bitwise at its fault-free model,
and the report says so; a torchrun anchor past its deadline is a failed row, not a lost report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.cli.main import main

pytestmark = pytest.mark.timeout(300)


def test_two_drawn_kills_of_recovering_strategies_end_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    report = tmp_path / "chaos.json"
    code = main(
        [
            "bench",
            "chaos",
            "--runs",
            "2",
            "--seed",
            "4",
            "--torchrun",
            "0",
            "--out",
            str(tmp_path / "runs"),
            "--json",
            str(report),
        ]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    found = json.loads(report.read_text())
    assert [(r["strategy"], r["kill"], r["restarts"], r["spare"], r["outcome"]) for r in found["runs"]] == [
        ("allreduce", "1@step=4", 1, False, "bitwise"),
        ("sfb", "0@step=3,1@step=11", 2, True, "bitwise"),
    ]
    out = capsys.readouterr().out
    assert "| allreduce | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in out
    assert "| two workers | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in out
    assert "| worker step, restarted cold | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in out


def test_a_torchrun_anchor_past_its_deadline_is_recorded_failed_and_killed(tmp_path: Path) -> None:
    """A torchrun run that outlives its deadline (here 0.3 s: torchrun cannot even start its workers) is a
    failed row of the report, its whole process group killed, rather than an exception that loses the report."""
    pytest.importorskip("torch")
    from paratrain.bench.recovery import torchrun_anchor

    got = torchrun_anchor(tmp_path, kill_step=9, every=5, deadline=0.3)
    assert got["error"] == "hung: still running after 0.3 s"
    assert "total_s" not in got
