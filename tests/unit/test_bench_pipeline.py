"""`paratrain bench pipeline`: the bubble from trace spans, the loss check, the tables, argument checks, and one
tiny run end to end (no timing asserted: the machine decides those)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paratrain.bench.pipeline import (
    PipelineBenchOptions,
    check_losses,
    combine,
    compute_seconds,
    idle_fraction,
    imbalance,
    render,
    summarize,
    theory_bubble,
)
from paratrain.errors import ConfigError

pytest.importorskip("torch")

CLI = [sys.executable, "-m", "paratrain.cli.main", "bench", "pipeline"]


def test_theory_is_k_minus_1_over_m_plus_k_minus_1() -> None:
    assert theory_bubble(2, 8) == pytest.approx(1 / 9)
    assert theory_bubble(4, 8) == pytest.approx(3 / 11)
    assert theory_bubble(3, 1) == pytest.approx(2 / 3)


def test_idle_is_the_step_minus_its_compute_spans() -> None:
    # stage 1 of GPipe, K=2, M=2, unit forward and 2-unit backward: waits 1 for the first activation
    spans = [
        ("wait activation 0", "waiting", 0.0, 1.0),
        ("forward 0", "compute", 1.0, 2.0),
        ("forward 1", "compute", 2.0, 3.0),
        ("backward 0", "compute", 3.0, 5.0),
        ("backward 1", "compute", 5.0, 7.0),
        ("optimizer step", "compute", 7.0, 7.5),
        ("wait sends", "waiting", 7.5, 8.0),
        ("step", "step", 0.0, 8.0),
    ]
    assert compute_seconds(spans) == pytest.approx(6.5)
    assert idle_fraction(spans) == pytest.approx(1.5 / 8)


def test_compute_outside_the_step_is_clipped_and_a_step_span_is_required() -> None:
    assert idle_fraction([("forward 0", "compute", -1.0, 1.0), ("step", "step", 0.0, 2.0)]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="step"):
        idle_fraction([("forward 0", "compute", 0.0, 1.0)])


def test_imbalance_is_slowest_over_mean() -> None:
    assert imbalance([2.0, 2.0]) == 1.0
    assert imbalance([1.0, 2.0, 3.0]) == pytest.approx(1.5)


def test_a_loss_that_differs_is_refused() -> None:
    assert check_losses([100.0, 99.0], [100.0, 99.0004]) is None  # 4e-6 relative: float32 rounding
    why = check_losses([100.0, 98.0], [100.0, 99.0])
    assert why is not None and "step 2" in why and "refused" in why
    assert check_losses([], [1.0]) == "reported 0 losses, one process 1"


def _payload(stage: int, seconds: float, *, spans: bool) -> dict[str, Any]:
    steps = [[("forward 0", "compute", 0.0, 0.9), ("step", "step", 0.0, 1.0)]] * 3
    return {
        "stage": stage,
        "seconds": seconds,
        "steps": 3,
        "batch_size": 16,
        "step_walls": [1.0, 1.0, 1.0],
        "rss_base_bytes": 1000,
        "rss_peak_bytes": 900 if stage else 5096,  # a peak below the base (memory given back) counts as 0
        "held_bytes": 8192 * (stage + 1),
        "held_bytes_checkpoint": 1024,
        **({"spans": steps} if spans else {}),
    }


def test_summarize_takes_the_slowest_stage_and_medians_per_stage() -> None:
    row = summarize("paratrain-gpipe-mlp-k2", [_payload(1, 4.0, spans=True), _payload(0, 3.0, spans=True)])
    assert row["samples_per_s"] == pytest.approx(3 * 16 / 4.0)
    assert row["step_ms"] == pytest.approx(4000 / 3)
    assert [s["stage"] for s in row["stages"]] == [0, 1]
    assert row["stages"][0]["rss_growth_bytes"] == 4096 and row["stages"][1]["rss_growth_bytes"] == 0
    assert row["stages"][0]["idle"] == pytest.approx(0.1)
    merged = combine([row, {**row, "samples_per_s": 1.0}, {**row, "samples_per_s": 100.0}])
    assert merged["samples_per_s"] == pytest.approx(12.0) and merged["samples_per_s_runs"] == [12.0, 1.0, 100.0]


def _report() -> dict[str, Any]:
    single = combine([summarize("single-mlp", [_payload(0, 6.0, spans=False)])])
    pt = combine([summarize("paratrain-gpipe-mlp-k2", [_payload(0, 3.0, spans=True), _payload(1, 3.0, spans=True)])])
    return {
        "models": ["mlp"],
        "microbatches": 8,
        "batch_size": 16,
        "steps": 3,
        "warmup": 2,
        "repeat": 1,
        "schedules": ["gpipe"],
        "machine": {"cpus": 2, "processor": "test", "load_before": [0.0], "load_after": [0.0]},
        "cases": [
            {
                "model": "mlp",
                "stages": 2,
                "balance": [2, 4],
                "predicted_imbalance": 1.05,
                "input_bytes": [1024, 1024],
            }
        ],
        "engines": {
            "single-mlp": {"status": "ok", "detail": ""},
            "paratrain-gpipe-mlp-k2": {"status": "ok", "detail": ""},
            "torch-gpipe-mlp-k2": {"status": "error", "detail": "step 1 loss 2 differs from one process's 1: refused"},
        },
        "results": {"single-mlp": single, "paratrain-gpipe-mlp-k2": pt},
    }


def test_the_tables_show_every_engine_its_ratios_and_the_targets() -> None:
    text = render(_report())
    assert "one process, 1 thread" in text and "paratrain Pipe gpipe" in text
    assert "2.00x" in text  # paratrain's samples/s over one process's: 16 vs 8
    assert "torch pipelining gpipe" in text and "error" in text and "refused" in text  # shown, never timed
    assert "11.1%" in text and "10.0%" in text  # theory (K-1)/(M+K-1) and the measured idle
    assert "vs one process 2.00x >= 1.6x: met" in text
    assert "partitioner's slowest / mean predicted 1.05 <= 1.1: met" in text
    assert "micro-batches held per stage 8.0, 8.0 <= [8, 8]: met" in text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"models": ("vgg",)}, "unknown --model"),
        ({"stages": (1,)}, "--stages"),
        ({"schedules": ("pipedream",)}, "--schedules"),
        ({"batch_size": 100, "microbatches": 8}, "multiple of --microbatches"),
        ({"warmup": 1}, "--warmup"),
        ({"repeat": 0}, "--repeat"),
        ({"balance": (1, 2, 3)}, "--balance"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PipelineBenchOptions(**fields)


def test_bad_flags_exit_2_before_anything_runs() -> None:
    out = subprocess.run([*CLI, "--stages", "1"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--stages must be at least 2" in out.stderr


def test_one_tiny_run_end_to_end(tmp_path: Path) -> None:
    """One process and paratrain's Pipe, one step. torch.distributed.pipelining is left out here: every process
    pays about 2.5 s of CPU to import torch on the 2-core VM, and its 2 more would take the test past 20 s; the
    benchmark's README command runs it (and checks its losses against one process's)."""
    path = tmp_path / "r.json"
    flags = ["--model", "mlp", "--schedules", "1f1b", "--batch-size", "16", "--microbatches", "4", "--steps", "1"]
    flags.append("--no-torch")
    out = subprocess.run(
        [*CLI, *flags, "--warmup", "2", "--repeat", "1", "--timeout", "60", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(path.read_text())
    assert set(report["results"]) == {"single-mlp", "paratrain-1f1b-mlp-k2"}
    assert all(info["status"] == "ok" for info in report["engines"].values())
    assert "paratrain Pipe 1f1b" in out.stdout and "targets (issue 12):" in out.stdout
