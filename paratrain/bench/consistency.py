"""``paratrain bench consistency``: BSP, SSP(s), ASP and allreduce side by side under stragglers.

The experiment behind Ho et al.'s claim (NIPS 2013: SSP converges faster in wall time than BSP, and than ASP,
when workers straggle). For every straggler scenario and every strategy, one ``paratrain train`` job with the
same model, data, seed and learning rate (the parameter server's one update rule makes the step per clock the
same in every consistency model, so the comparison is of consistency, not of step size). Rounds are
interleaved — round 1 runs every (scenario, strategy) once, then round 2, ... — so slow drifts of the machine
hit every cell alike; each cell reports the median over rounds and the spread (min-max).

Measured per job: *time to target* — rank 0's training time (evaluations excluded) until its test accuracy,
probed every ``eval_every`` steps on a fixed test subset, first reaches the target; *final accuracy* — rank
0's model on the whole test set after the last epoch; *samples/s* — all workers' samples / training time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paratrain.bench.harness import require_at_least_one
from paratrain.bench.stats import median_spread
from paratrain.errors import ConfigError

__all__ = ["ConsistencyBenchOptions", "render_tables", "run_consistency_bench", "summarise_cells"]

DEFAULT_STRATEGIES = ("allreduce", "bsp", "ssp:1", "ssp:3", "ssp:10", "asp")
DEFAULT_SCENARIOS = ("none", "1:3", "random:0.1:4", "pareto:2:0.5")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsistencyBenchOptions:
    """What to run: strategies x straggler scenarios x rounds, and the job they share."""

    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    model: str = "lenet"
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    workers: int = 4
    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.05
    seed: int = 0
    repeat: int = 3
    target: float = 0.75
    eval_every: int = 20
    out: str = field(default_factory=lambda: f"runs/consistency-{time.strftime('%Y%m%d-%H%M%S')}")

    def __post_init__(self) -> None:
        if not self.strategies or not self.scenarios:
            raise ConfigError("--strategies and --scenarios must each name at least one")
        require_at_least_one(self, "workers", "epochs", "batch_size", "repeat", "eval_every")
        if not 0 < self.target <= 1:
            raise ConfigError(f"--target must be an accuracy in (0, 1], got {self.target}")

    def job(self, strategy: str, scenario: str, run_dir: Path) -> Any:
        """The ``paratrain train`` job of one cell (validated)."""
        from paratrain.train.checks import validate
        from paratrain.train.job import TrainJob

        shared = ("model", "dataset", "data_dir", "epochs", "batch_size", "lr", "seed", "workers", "eval_every")
        straggler = None if scenario == "none" else scenario
        return validate(
            TrainJob(
                **{name: getattr(self, name) for name in shared},
                strategy=strategy,
                run_dir=str(run_dir),
                straggler=straggler,
            )
        )


def _cell_dir(out: Path, scenario: str, strategy: str, round_index: int) -> Path:
    clean = scenario.replace(":", "_").replace(".", "p")
    return out / clean / strategy.replace(":", "") / f"round{round_index + 1}"


def run_consistency_bench(options: ConsistencyBenchOptions, *, log: Any = sys.stderr) -> dict[str, Any]:
    """Runs every cell ``repeat`` times, interleaved; returns the report (also written as JSON under ``out``)."""
    from paratrain.train.compare import accuracy_curve, time_to_accuracy
    from paratrain.train.record import merge_run
    from paratrain.train.run import run_training

    out = Path(options.out)
    jobs = [
        (r, scenario, strategy, options.job(strategy, scenario, _cell_dir(out, scenario, strategy, r)))
        for r in range(options.repeat)
        for scenario in options.scenarios
        for strategy in options.strategies
    ]
    runs: list[dict[str, Any]] = []
    started = time.time()
    for n, (r, scenario, strategy, job) in enumerate(jobs):
        summary = run_training(job, quiet=True)
        records = merge_run(summary["run_dir"])
        tta = time_to_accuracy(records, options.target)
        runs.append(
            {
                "round": r + 1,
                "scenario": scenario,
                "strategy": strategy,
                "time_to_target_s": tta,
                "test_accuracy": summary["test_accuracy"],
                "samples_per_sec": summary["samples_per_sec"],
                "train_time_s": summary["train_time_s"],
                "wait_share": _wait_share(summary),
                "curve": accuracy_curve(records),  # what the figure draws
                "run_dir": summary["run_dir"],
            }
        )
        reached = f"{tta:.1f} s" if tta is not None else "not reached"
        print(
            f"[{n + 1}/{len(jobs)}, {time.time() - started:.0f} s] round {r + 1}, straggler {scenario}, {strategy}: "
            f"time to {options.target} {reached}, test accuracy {summary['test_accuracy']:.4f}, "
            f"{summary['samples_per_sec']:,.0f} samples/s",
            file=log,
            flush=True,
        )
    report = {
        "benchmark": "consistency",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "options": asdict(options),
        "cells": summarise_cells(runs, options),
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "consistency.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "consistency.png")
    (out / "consistency.md").write_text(render_tables(report) + "\n")
    return report


def _wait_share(summary: dict[str, Any]) -> float:
    entries = list(summary["per_rank"].values())
    total = sum(e["compute_s"] + e["wait_s"] for e in entries)
    return sum(e["wait_s"] for e in entries) / total if total else 0.0


def summarise_cells(runs: list[dict[str, Any]], options: ConsistencyBenchOptions) -> list[dict[str, Any]]:
    """One row per (scenario, strategy): medians and spreads over rounds; the median round's curve.

    A round that never reached the target counts as infinitely slow in the median of time to target, so a
    strategy that reaches it in only one round of three has no median (``None``), and ``reached`` says in how
    many rounds it did.
    """
    cells = []
    for scenario in options.scenarios:
        for strategy in options.strategies:
            mine = [r for r in runs if r["scenario"] == scenario and r["strategy"] == strategy]
            if not mine:
                continue
            times = [r["time_to_target_s"] for r in mine]
            reached = [t for t in times if t is not None]
            ordered = sorted(float("inf") if t is None else t for t in times)
            median_time = statistics.median(ordered) if ordered else float("inf")
            by_time = sorted(
                mine, key=lambda r: float("inf") if r["time_to_target_s"] is None else r["time_to_target_s"]
            )
            cells.append(
                {
                    "scenario": scenario,
                    "strategy": strategy,
                    "rounds": len(mine),
                    "reached": len(reached),
                    "time_to_target_s": None if median_time == float("inf") else median_time,
                    "time_to_target_spread": median_spread(reached),
                    "test_accuracy": median_spread([r["test_accuracy"] for r in mine]),
                    "samples_per_sec": median_spread([r["samples_per_sec"] for r in mine if r["samples_per_sec"]]),
                    "wait_share": statistics.median(r["wait_share"] for r in mine),
                    "curve": by_time[(len(by_time) - 1) // 2]["curve"],
                }
            )
    return cells


def render_tables(report: dict[str, Any]) -> str:
    """One Markdown table per straggler scenario: time to target (and vs BSP), final accuracy, samples/s."""
    options = report["options"]
    target = options["target"]
    parts = []
    for scenario in options["scenarios"]:
        cells = [c for c in report["cells"] if c["scenario"] == scenario]
        bsp = next((c["time_to_target_s"] for c in cells if c["strategy"] == "bsp"), None)
        parts.append(f"straggler: {scenario}\n")
        parts.append(
            f"| strategy | time to {target} (s) | vs bsp | final test acc | samples/s | comm wait |\n"
            "|---|---:|---:|---:|---:|---:|"
        )
        for c in cells:
            tta, spread = c["time_to_target_s"], c["time_to_target_spread"]
            if tta is None:
                when = f"not reached ({c['reached']}/{c['rounds']})"
                ratio = "-"
            else:
                when = f"{tta:.1f} ({spread['min']:.1f}-{spread['max']:.1f})"
                if c["reached"] < c["rounds"]:
                    when += f" [{c['reached']}/{c['rounds']}]"
                ratio = f"{bsp / tta:.2f}x" if bsp else "-"
            acc, sps = c["test_accuracy"], c["samples_per_sec"]
            rate = f"{sps['median']:,.0f} ({sps['min']:,.0f}-{sps['max']:,.0f})" if sps else "-"
            parts.append(
                f"| {c['strategy']} | {when} | {ratio} | {acc['median']:.4f} ({acc['min']:.4f}-{acc['max']:.4f}) "
                f"| {rate} | {c['wait_share']:.0%} |"
            )
        parts.append("")
    parts.append(
        f"time to {target}: rank 0's training time (evaluations excluded) until its test accuracy on a fixed "
        f"test subset, probed every {options['eval_every']} steps, first reached {target}; median (min-max) over "
        f"{options['repeat']} interleaved rounds. vs bsp: bsp's time / this time (> 1: faster than BSP)."
    )
    return "\n".join(parts)


def plot(report: dict[str, Any], path: Path) -> None:
    """Accuracy against training time (median round) per scenario, and time to target as bars below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options = report["options"]
    scenarios, strategies = options["scenarios"], options["strategies"]
    fig, axes = plt.subplots(2, len(scenarios), figsize=(4.2 * len(scenarios), 7.5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, scenario in enumerate(scenarios):
        top, bottom = axes[0][col], axes[1][col]
        cells = {c["strategy"]: c for c in report["cells"] if c["scenario"] == scenario}
        for i, strategy in enumerate(strategies):
            cell = cells.get(strategy)
            if cell is None or not cell["curve"]:
                continue
            xs, ys = zip(*cell["curve"], strict=True)
            top.plot(xs, ys, "-", lw=1.3, color=colours[i % len(colours)], label=strategy)
        top.axhline(options["target"], color="grey", lw=0.8, ls=":")
        top.set_title(f"straggler: {scenario}")
        top.set_xlabel("training time (s)")
        top.set_ylim(max(0.0, options["target"] - 0.3), min(1.0, options["target"] + 0.12))
        bars, lows, highs, labels = [], [], [], []
        for strategy in strategies:
            cell = cells.get(strategy)
            tta = cell["time_to_target_s"] if cell else None
            spread = cell["time_to_target_spread"] if cell else None
            value = tta if tta is not None else 0.0
            bars.append(value)
            lows.append(value - spread["min"] if spread and tta is not None else 0.0)
            highs.append(spread["max"] - value if spread and tta is not None else 0.0)
            labels.append(strategy if tta is not None else f"{strategy}\n(not reached)")
        bottom.bar(range(len(bars)), bars, yerr=[lows, highs], color=colours[: len(bars)], capsize=3)
        bottom.set_xticks(range(len(bars)), labels, rotation=45, ha="right", fontsize=8)
        bottom.set_ylabel(f"time to {options['target']} (s)")
    axes[0][0].set_ylabel("test accuracy (rank 0)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"{options['model']} on {options['dataset']}, {options['workers']} workers, batch {options['batch_size']}, "
        f"lr {options['lr']}: median of {options['repeat']} rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
