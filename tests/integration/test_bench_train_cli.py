"""`paratrain bench train` end to end on a few steps: the table, the JSON, and clear errors (no timings asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-m", "paratrain.cli.main", "bench", "train"]


def test_bench_train_runs_every_engine(tmp_path: Path) -> None:
    out = subprocess.run(
        [*CLI, "--steps", "3", "--warmup", "1", "--repeat", "1", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "paratrain allreduce" in out.stdout and "torch DDP (Gloo)" in out.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["samples_per_sec"]) == {"single", "single_1thread", "paratrain", "ddp"}
    assert all(v > 0 for v in report["samples_per_sec"].values())
    assert report["paratrain_vs_ddp"] > 0


@pytest.mark.parametrize(
    ("flags", "message"), [(["--model", "vgg"], "unknown --model"), (["--workers", "0"], "--workers")]
)
def test_bad_flags(flags: list[str], message: str) -> None:
    out = subprocess.run([*CLI, *flags], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and message in out.stderr
