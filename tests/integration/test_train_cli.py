"""`paratrain train` and `paratrain compare` end to end: real processes, real data, the run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "paratrain.cli.main"]


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _train(tmp: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "train", "--run-dir", str(tmp / name), *flags], capture_output=True, text=True, timeout=150, check=False
    )


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "step" and r["rank"] == 0]


def test_train_writes_the_run_directory_and_is_reproducible(tmp_path: Path) -> None:
    out = _train(tmp_path, "a", "--epochs", "2", "--seed", "3", "--json", str(tmp_path / "a.json"))
    assert out.returncode == 0, out.stderr
    assert "test accuracy" in out.stdout
    run = tmp_path / "a"
    for name in ("metrics.jsonl", "timeline.json", "loss.png", "accuracy.png", "summary.json"):
        assert (run / name).exists(), name
    summary = json.loads((tmp_path / "a.json").read_text())
    for key in ("test_accuracy", "samples_per_sec", "wall_time_s", "strategy", "workers"):
        assert key in summary
    assert summary["strategy"] == "allreduce" and summary["workers"] == 2
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    timeline = json.loads((run / "timeline.json").read_text())
    assert {e["pid"] for e in timeline["traceEvents"] if e["ph"] == "X"} == {0, 1}
    # the same seed gives the same run, step for step; another seed another one
    again = _train(tmp_path, "b", "--epochs", "2", "--seed", "3")
    other = _train(tmp_path, "c", "--epochs", "2", "--seed", "4")
    assert again.returncode == 0 and other.returncode == 0
    assert _losses(run) == _losses(tmp_path / "b")
    assert _losses(run) != _losses(tmp_path / "c")


def test_parameter_server_strategy_runs(tmp_path: Path) -> None:
    out = _train(tmp_path, "ps", "--epochs", "1", "--strategy", "ssp:2", "--json", str(tmp_path / "s.json"))
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["strategy"] == "ssp:2" and summary["servers"] == 1


def test_sfb_trains_the_allreduce_model_and_prints_its_plan(tmp_path: Path) -> None:
    """sfb on one host (collectives over shared memory): the plan is printed and the losses are allreduce's, up
    to float rounding (the same mean gradient, summed in another order)."""
    out = _train(tmp_path, "sfb", "--epochs", "1", "--strategy", "sfb", "--layer-scheme", "5=dense")
    assert out.returncode == 0, out.stderr
    assert "per-layer schemes" in out.stderr and "sfb (set)" in out.stderr and "allreduce (set)" in out.stderr
    ref = _train(tmp_path, "ref", "--epochs", "1")
    assert ref.returncode == 0, ref.stderr
    assert _losses(tmp_path / "sfb") == pytest.approx(_losses(tmp_path / "ref"), rel=1e-4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "carrier-pigeon"], "unknown --strategy"),
        (["--strategy", "ssp"], "ssp:S"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--model", "resnet"], "unknown --model"),
        (["--straggler", "5:2"], "RANK:FACTOR"),
        (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent"], "apt-get install dataset-fashion-mnist"),
        (["--latency", "2ms", "--faults", "latency=1ms"], "both given"),
        (["--bandwidth", "fast"], "is not a bandwidth"),
        (["--strategy", "gossip:star"], "neither one of ring"),
        (["--compression", "zip"], "unknown compression"),
        (["--layer-scheme", "1=sfb"], "--layer-scheme is for poseidon"),
        (["--strategy", "bsp", "--compression", "powersgd:2"], "PowerSGD needs two allreduce rounds"),
        (["--strategy", "pipeline:gpipe", "--device", "cuda"], "Pipe(device=...)"),
        pytest.param(
            ["--device", "cuda"],
            "torch sees no CUDA device",
            marks=pytest.mark.skipif(_has_cuda(), reason="a CUDA device is here"),
        ),
    ],
)
def test_bad_flags_give_a_clear_message(tmp_path: Path, flags: list[str], message: str) -> None:
    out = _train(tmp_path, "bad", *flags)
    assert out.returncode == 2
    assert message in out.stderr


def test_compare_draws_the_strategies_together(tmp_path: Path) -> None:
    out = subprocess.run(
        [*CLI, "compare", "--strategies", "allreduce,gossip:ring", "--workers", "3", "--epochs", "1",
         "--out", str(tmp_path / "cmp"), "--target-accuracy", "0.5", "--straggler", "1:2", "--latency", "1ms",
         "--bandwidth", "1Gbit"],
        capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cmp" / "compare.png").exists()
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    allreduce, gossip = result["runs"]
    assert allreduce["strategy"] == "allreduce" and gossip["strategy"] == "gossip:ring"
    assert allreduce["network"] == gossip["network"] == "latency=1ms,bandwidth=1Gbit"
    # gossip's workers differ, so its average model is evaluated too; allreduce's workers are identical
    assert allreduce["consensus_accuracy"] is None
    assert 0.0 <= gossip["consensus_accuracy"] <= 1.0 and gossip["consensus_distance"] >= 0.0
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| strategy |") and rows[1].startswith("| allreduce |")
    assert rows[2].startswith("| gossip:ring |") and " - |" not in rows[2]


def test_gossip_on_a_ring_of_4_matches_allreduce_accuracy(tmp_path: Path) -> None:
    """Issue 6's bar: D-PSGD on a ring of 4 workers ends within 1 % of allreduce's test accuracy (digits, 10
    epochs, seed 0; both runs are deterministic). Over seeds 0-4 the largest gap measured was 0.56 %."""
    accuracy = {}
    for strategy in ("allreduce", "gossip:ring"):
        summary_path = tmp_path / f"{strategy.replace(':', '')}.json"
        out = _train(tmp_path, strategy.replace(":", ""), "--workers", "4", "--strategy", strategy,
                     "--json", str(summary_path))  # fmt: skip
        assert out.returncode == 0, out.stderr
        accuracy[strategy] = json.loads(summary_path.read_text())["test_accuracy"]
    assert accuracy["gossip:ring"] >= accuracy["allreduce"] - 0.01, accuracy


def test_compare_repeats_rounds_and_reports_the_spread(tmp_path: Path) -> None:
    out = subprocess.run(
        [*CLI, "compare", "--strategies", "allreduce", "--repeat", "2", "--epochs", "1", "--out", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "c" / "compare.json").read_text())
    [row] = result["runs"]
    assert result["repeat"] == 2 and len(result["all_rounds"]["allreduce"]) == 2
    rounds = row["samples_per_sec_rounds"]
    assert len(rounds) == 2 and row["samples_per_sec"] in rounds  # the median round (of two: the slower) stands
    assert (tmp_path / "c" / "allreduce" / "round1" / "summary.json").exists()
    assert (tmp_path / "c" / "allreduce" / "round2" / "summary.json").exists()
    table_row = next(line for line in out.stdout.splitlines() if line.startswith("| allreduce |"))
    assert f"({min(rounds):,.0f}-{max(rounds):,.0f})" in table_row
    bad = subprocess.run([*CLI, "compare", "--strategies", "asp,asp"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "more than once" in bad.stderr
