"""`paratrain train --straggler`: the slowdowns the ranks applied are the model's, step for step, from --seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.train.stragglers import parse

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "paratrain.cli.main"]


def test_random_stragglers_follow_the_seeded_model(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = subprocess.run(
        [*CLI, "train", "--epochs", "1", "--seed", "4", "--straggler", "random:0.5:2", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "epoch 1/1: train loss" in out.stdout  # printed once, through the progress bar
    assert out.stdout.count("epoch 1/1:") == 1
    model = parse("random:0.5:2", seed=4)
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert {r["rank"] for r in steps} == {0, 1}
    factors = [r["straggler_factor"] for r in steps]
    assert factors == [model.factor(r["rank"], r["step"]) for r in steps]
    assert set(factors) == {1.0, 2.0}  # both kinds of step happened (22 draws at p = 0.5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("pareto:1", "ALPHA must be > 1"), ("random:2:3", "P is a probability"), ("lognormal:1", "RANK:FACTOR")],
)
def test_bad_straggler_specs_are_refused_up_front(tmp_path: Path, spec: str, message: str) -> None:
    out = subprocess.run(
        [*CLI, "train", "--straggler", spec, "--run-dir", str(tmp_path / "bad")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
