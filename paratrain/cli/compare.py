"""``paratrain compare``: the same training job under several strategies, drawn on one figure.

Each strategy runs as a full ``paratrain train`` job (same model, data, seed, workers, emulated network and
straggler), one after the other so that they never share the CPUs. The figure puts training loss against wall
time and against steps, and test accuracy against wall time, one line per strategy; the table (Markdown) gives
final accuracy, throughput, the share of time spent waiting for communication and the time each strategy took
to first reach ``--target-accuracy``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from paratrain.cli.errors import reports_config_errors
from paratrain.errors import ConfigError
from paratrain.train.compare import accuracy_curve, format_table, time_to_accuracy
from paratrain.train.record import reporting_rank

__all__ = ["accuracy_curve", "add_parser", "format_table", "time_to_accuracy"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``compare`` on the ``paratrain`` parser."""
    from paratrain.train.job import add_job_options

    p = sub.add_parser(
        "compare",
        help="run the same training job under several strategies and plot them together",
        description=(
            "Run one training job per strategy (the same model, data, seed and emulated network) and draw loss "
            "against wall time and steps, and test accuracy against wall time, on one figure, with a table."
        ),
    )
    p.add_argument(
        "--strategies",
        default="allreduce,bsp,ssp:3,asp",
        help="comma-separated: allreduce, bsp, ssp:S, asp, gossip:GRAPH, poseidon[:allreduce], sfb, each optionally "
        "+COMPRESSION (allreduce+topk:0.01, bsp+fp16) (default allreduce,bsp,ssp:3,asp)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of the whole comparison (strategies interleaved); the table shows median (min-max) samples/s",
    )
    p.add_argument("--target-accuracy", type=float, default=0.9, help="for the time-to-accuracy column (0.9)")
    p.add_argument("--out", default=None, help="output directory (default runs/compare-<time>)")
    p.add_argument("--json", default=None, help="also write the comparison to this JSON file")
    add_job_options(p, "compare")
    p.set_defaults(func=_main)


def _plot(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    for name, records in runs.items():
        rank = reporting_rank(records)  # 0, or a pipeline's last stage (it has the loss)
        steps = [r for r in records if r.get("kind") == "step" and r.get("rank") == rank]
        if not steps:
            continue
        start = steps[0]["time"] - steps[0]["compute_s"] - steps[0]["wait_s"]
        axes[0].plot([r["time"] - start for r in steps], [r["loss"] for r in steps], lw=0.8, label=name)
        axes[1].plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, label=name)
        evals = [r for r in records if r.get("kind") == "eval" and r.get("rank") == rank]
        axes[2].plot([r["time"] - start for r in evals], [r["test_accuracy"] for r in evals], "o-", ms=3, label=name)
    axes[0].set_xlabel("wall time (s)")
    axes[1].set_xlabel("step")
    axes[2].set_xlabel("wall time (s)")
    for ax in axes[:2]:
        ax.set_ylabel("training loss (rank 0; a pipeline's last stage)")
        ax.set_yscale("log")
    axes[2].set_ylabel("test accuracy (rank 0, after each epoch)")
    for ax in axes:
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@reports_config_errors("compare")
def _main(args: argparse.Namespace) -> int:
    import time

    from paratrain.train.checks import validate
    from paratrain.train.extra import require_train_extra
    from paratrain.train.job import TrainJob
    from paratrain.train.record import merge_run
    from paratrain.train.run import run_training

    if not require_train_extra("compare"):
        return 2
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    base = TrainJob.from_args(args)  # (compare's own --json is the comparison's, not a job's)
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be at least 1, got {args.repeat}")
    if not strategies:
        raise ConfigError("--strategies is empty; name at least one, e.g. allreduce,gossip:ring")
    twice = sorted({name for name in strategies if strategies.count(name) > 1})
    if twice:
        raise ConfigError(f"--strategies lists {', '.join(twice)} more than once; use --repeat for rounds")
    rounds: list[list[TrainJob]] = []
    labels: dict[int, str] = {}
    for r in range(args.repeat):
        jobs = []
        for label in strategies:
            # "allreduce+topk:0.01": the strategy, compressed (the same strategy can run with and without)
            strategy, plus, compression = label.partition("+")
            run_dir = out / label.replace(":", "").replace("+", "-")
            if args.repeat > 1:
                run_dir = run_dir / f"round{r + 1}"
            job = base.replace(strategy=strategy, run_dir=str(run_dir), json=None)
            if plus:
                job = job.replace(compression=compression)
            job = validate(job)
            labels[id(job)] = label
            jobs.append(job)
        rounds.append(jobs)
    done: dict[str, list[tuple[dict[str, Any], list[dict[str, Any]]]]] = {s: [] for s in strategies}
    for r, jobs in enumerate(rounds):
        for job in jobs:
            where = f" (round {r + 1} of {args.repeat})" if args.repeat > 1 else ""
            label = labels[id(job)]
            print(f"paratrain compare: running {label}{where} ...", file=sys.stderr, flush=True)
            summary = run_training(job)  # with its progress bar: a throttled job can take a minute
            records = merge_run(summary["run_dir"])
            row = {**summary, "strategy": label, "time_to_accuracy_s": time_to_accuracy(records, args.target_accuracy)}
            done[label].append((row, records))
    jobs = rounds[0]
    runs: dict[str, list[dict[str, Any]]] = {}
    rows = []
    for strategy, results in done.items():
        # the round with the median throughput stands for the strategy (table, figure); all rounds are kept
        ordered = sorted(results, key=lambda item: item[0]["samples_per_sec"] or 0.0)
        row, records = ordered[(len(ordered) - 1) // 2]
        runs[strategy] = records
        rows.append({**row, "samples_per_sec_rounds": [item[0]["samples_per_sec"] for item in results]})
    title = (
        f"{args.model} on {args.dataset}, {jobs[0].workers} worker{'s' if jobs[0].workers != 1 else ''}"
        + (f", straggler {args.straggler}" if args.straggler else "")
        + (f", network {jobs[0].network()}" if jobs[0].network() else "")
    )
    _plot(runs, out / "compare.png", title)
    print(format_table(rows, args.target_accuracy))
    print(f"figure: {out / 'compare.png'}")
    result = {
        "target_accuracy": args.target_accuracy,
        "repeat": args.repeat,
        "runs": rows,
        "all_rounds": {strategy: [row for row, _ in results] for strategy, results in done.items()},
        "figure": str(out / "compare.png"),
    }
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
