"""``paratrain train --strategy tp:N|soap:FILE`` end to end: split layers over real processes train what data
parallelism trains (the same global batch, the same model up to float32 rounding), each worker holding about 1/N
of the split layers' parameters, as the summary reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.timeout(240)

CLI = [sys.executable, "-m", "paratrain.cli.main", "train", "--epochs", "1", "--steps-per-epoch", "8"]


def _train(tmp: Path, name: str, *flags: str) -> tuple[dict[str, object], dict[str, object]]:
    out = subprocess.run(
        [*CLI, "--run-dir", str(tmp / name), "--json", str(tmp / f"{name}.json"), *flags],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp / f"{name}.json").read_text())
    summary["stdout"] = out.stdout
    return summary, torch.load(tmp / name / "model.pt")


def _furthest(a: dict[str, object], b: dict[str, object]) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)  # type: ignore[operator]


def test_tp2_splits_convolutions_and_linear_layers_and_trains_as_one_process(tmp_path: Path) -> None:
    split, model = _train(tmp_path, "tp", "--strategy", "tp:2", "--model", "lenet", "--eval-every", "4")
    _, reference = _train(tmp_path, "one", "--strategy", "allreduce", "--workers", "1", "--model", "lenet")
    assert _furthest(model, reference) < 1e-5
    tensor = split["tensor"]
    assert tensor["splits"] == {"0": "column", "3": "row", "7": "column", "9": "row"}  # type: ignore[index]
    assert (tensor["tensor"], tensor["data"]) == (2, 1)  # type: ignore[index]
    assert 0.5 <= tensor["params_share"] < 0.55  # type: ignore[index]  # the last layer and row biases stay whole
    assert "split layers: 2-way tensor x 1 data group (0=column, 3=row, 7=column, 9=row)" in split["stdout"]
    records = [json.loads(line) for line in (tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()]
    probes = sorted((r["rank"], r["step"]) for r in records if r["kind"] == "probe")
    assert probes == [(0, 4), (0, 8), (1, 4), (1, 8)]  # --eval-every: every rank evaluates (the moves need both)


def test_a_configuration_file_on_a_2x2_grid_trains_as_two_data_parallel_workers(tmp_path: Path) -> None:
    config = tmp_path / "grid.json"
    config.write_text('{"tensor": 2, "data": 2, "splits": {"1": "column", "3": "column", "5": "row"}}')
    split, model = _train(tmp_path, "grid", "--strategy", f"soap:{config}")
    _, reference = _train(tmp_path, "dp", "--strategy", "allreduce", "--workers", "2")
    assert split["workers"] == 4 and _furthest(model, reference) < 1e-5
    held = split["tensor"]["params_bytes_per_rank"]  # type: ignore[index]
    assert (
        held["0"] == held["2"] and held["1"] == held["3"] and held["0"] - held["1"] == 10 * 4
    )  # the row part's bias: 10 classes


def test_a_worker_killed_mid_step_fails_the_job_at_once_naming_the_cause(tmp_path: Path) -> None:
    out = subprocess.run(
        [*CLI, "--strategy", "tp:2", "--kill", "1@step=3", "--run-dir", str(tmp_path / "killed")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    # the launcher names the death (its partner, waiting in a split layer's collective, learns it there too,
    # unless the launcher stops it first)
    assert "rank 1 (pid" in text and "was killed by signal SIGKILL" in text, text
