"""``paratrain bench chaos`` end to end on two drawn schedules (seed 4: allreduce killed at step 14 and sfb at step
4, both with --max-restarts 1): each finishes bitwise at its fault-free model, and the report says so."""

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
        ["bench", "chaos", "--runs", "2", "--seed", "4", "--out", str(tmp_path / "runs"), "--json", str(report)]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    found = json.loads(report.read_text())
    assert [(r["strategy"], r["kill"], r["restarts"], r["outcome"]) for r in found["runs"]] == [
        ("allreduce", "0@step=14", 1, "bitwise"),
        ("sfb", "1@step=4", 1, "bitwise"),
    ]
    assert "| allreduce | 1 | 1 | 0 | 0 | 0 | 0 | 0 |" in capsys.readouterr().out
