"""The consistency benchmark's bookkeeping: medians over rounds, unreached targets, the tables."""

from __future__ import annotations

import pytest

from paratrain.bench.consistency import ConsistencyBenchOptions, render_tables, summarise_cells
from paratrain.errors import ConfigError


def _run(scenario: str, strategy: str, r: int, *, tta: float | None, acc: float, sps: float) -> dict[str, object]:
    return {
        "round": r,
        "scenario": scenario,
        "strategy": strategy,
        "time_to_target_s": tta,
        "test_accuracy": acc,
        "samples_per_sec": sps,
        "train_time_s": 10.0,
        "wait_share": 0.25,
        "curve": [(1.0 * r, acc)],
        "run_dir": "x",
    }


def test_cells_take_medians_and_count_unreached_rounds_as_slowest() -> None:
    options = ConsistencyBenchOptions(strategies=("bsp", "asp"), scenarios=("none",), repeat=3, out="unused")
    runs = [
        _run("none", "bsp", 1, tta=10.0, acc=0.80, sps=100.0),
        _run("none", "bsp", 2, tta=14.0, acc=0.82, sps=120.0),
        _run("none", "bsp", 3, tta=12.0, acc=0.81, sps=110.0),
        _run("none", "asp", 1, tta=5.0, acc=0.70, sps=300.0),
        _run("none", "asp", 2, tta=None, acc=0.60, sps=310.0),
        _run("none", "asp", 3, tta=None, acc=0.65, sps=290.0),
    ]
    bsp, asp = summarise_cells(runs, options)
    assert bsp["time_to_target_s"] == 12.0 and bsp["reached"] == 3
    assert bsp["time_to_target_spread"] == {"median": 12.0, "min": 10.0, "max": 14.0}
    assert bsp["test_accuracy"]["median"] == 0.81 and bsp["samples_per_sec"]["max"] == 120.0
    assert bsp["curve"] == [(3.0, 0.81)]  # the median round by time to target
    assert asp["time_to_target_s"] is None and asp["reached"] == 1  # median of (5, inf, inf) is inf
    table = render_tables({"options": _opts(options), "cells": [bsp, asp]})
    assert "| bsp | 12.0 (10.0-14.0) | 1.00x | 0.8100 (0.8000-0.8200) | 110 (100-120) | 25% |" in table
    assert "| asp | not reached (1/3) | - |" in table


def _opts(options: ConsistencyBenchOptions) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(options)


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        ConsistencyBenchOptions(strategies=(), out="unused")
    with pytest.raises(ConfigError, match="--target"):
        ConsistencyBenchOptions(target=1.5, out="unused")
    with pytest.raises(ConfigError, match="--eval-every"):
        ConsistencyBenchOptions(eval_every=0, out="unused")


def test_accuracy_curve_prefers_probes_and_leaves_evaluation_time_out() -> None:
    from paratrain.train.compare import accuracy_curve, time_to_accuracy

    records = [
        {"kind": "step", "rank": 0, "time": 101.0, "compute_s": 0.5, "wait_s": 0.5},  # training starts at 100
        {"kind": "probe", "rank": 0, "time": 103.0, "test_accuracy": 0.5, "eval_s": 1.0, "eval_before_s": 0.0},
        {"kind": "probe", "rank": 1, "time": 103.5, "test_accuracy": 0.9, "eval_s": 1.0, "eval_before_s": 0.0},
        {"kind": "probe", "rank": 0, "time": 106.0, "test_accuracy": 0.8, "eval_s": 1.0, "eval_before_s": 1.0},
        {"kind": "eval", "rank": 0, "time": 110.0, "test_accuracy": 0.85, "eval_s": 2.0, "eval_before_s": 2.0},
    ]
    assert accuracy_curve(records) == [(2.0, 0.5), (4.0, 0.8)]
    assert time_to_accuracy(records, 0.75) == 4.0 and time_to_accuracy(records, 0.9) is None
    epochs_only = [r for r in records if r["kind"] != "probe"]
    assert accuracy_curve(epochs_only) == [(6.0, 0.85)]
