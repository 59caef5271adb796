"""What a training run amounts to: the summary of its merged records (accuracy, throughput, where each rank's
time went; a pipeline's stages next to the bubble formula), and its printed form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.strategy import parse_strategy
from paratrain.train.job import TrainJob

__all__ = ["print_summary", "summarise"]


def summarise(
    records: list[dict[str, Any]], *, job: TrainJob, servers: int, wall: float, run_dir: Path
) -> dict[str, Any]:
    """The summary of a run: accuracy, throughput, time split between compute and waiting, per rank."""
    steps = [r for r in records if r.get("kind") == "step"]
    from paratrain.train.record import reporting_rank

    reporting = reporting_rank(records)
    evals = [r for r in records if r.get("kind") == "eval" and r.get("rank") == reporting]
    if steps:
        first = min(r["time"] - r["compute_s"] - r["wait_s"] for r in steps)
        train_time = max(r["time"] for r in steps) - first
        samples = sum(int(r["samples"]) for r in steps)
    else:
        train_time, samples = 0.0, 0
    per_rank: dict[int, dict[str, float]] = {}
    for r in steps:
        entry = per_rank.setdefault(
            int(r["rank"]), {"compute_s": 0.0, "wait_s": 0.0, "bytes_sent": 0.0, "allreduce_bytes": 0.0}
        )
        entry["compute_s"] += r["compute_s"]
        entry["wait_s"] += r["wait_s"]
        entry["bytes_sent"] = max(entry["bytes_sent"], float(r["bytes_sent"]))
        entry["allreduce_bytes"] = max(entry["allreduce_bytes"], float(r.get("allreduce_bytes", 0)))
    summary: dict[str, Any] = {
        "strategy": job.strategy,
        "compression": job.compression,
        "workers": job.workers,
        "servers": servers,
        "model": job.model,
        "dataset": job.dataset,
        "epochs": job.epochs,
        "batch_size": job.batch_size,
        "lr": job.lr,
        "seed": job.seed,
        "overlap": not job.no_overlap,
        "network": job.network(),
        "test_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "accuracy_by_epoch": [e["test_accuracy"] for e in evals],
        "consensus_accuracy": evals[-1].get("consensus_accuracy") if evals else None,
        "consensus_distance": evals[-1].get("consensus_distance") if evals else None,
        "samples_per_sec": samples / train_time if train_time > 0 else None,
        "train_time_s": train_time,
        "wall_time_s": wall,
        "per_rank": {str(k): v for k, v in sorted(per_rank.items())},
        "run_dir": str(run_dir),
    }
    spec = parse_strategy(job.strategy)
    if spec.pipelined:
        summary["pipeline"] = _pipeline_summary(records, job)
    if spec.splits_layers:
        summary["tensor"] = _tensor_summary(records)
    return summary


def _tensor_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Split layers: the grid, the splits, and the parameter bytes each worker holds against the unsplit model's
    (read from the workers' tensors)."""
    starts = {int(r["rank"]): r for r in records if r.get("kind") == "start"}
    first = starts.get(0, {})
    held = {str(rank): int(r["params_bytes"]) for rank, r in sorted(starts.items())}
    whole = int(first.get("whole_params_bytes", 0))
    return {
        "tensor": first.get("tensor"),
        "data": first.get("data"),
        "splits": first.get("splits"),
        "params_bytes_per_rank": held,
        "whole_params_bytes": whole,
        "params_share": max(held.values()) / whole if held and whole else None,
    }


def _pipeline_summary(records: list[dict[str, Any]], job: TrainJob) -> dict[str, Any]:
    """A pipeline's shape and, per stage (pipeline 0), its idle share next to GPipe's/1F1B's bubble formula."""
    starts = {int(r["rank"]): r for r in records if r.get("kind") == "start"}
    memory = {int(r["rank"]): int(r["peak_held_bytes"]) for r in records if r.get("kind") == "memory"}
    k, m = job.stages or 1, job.microbatches
    stages = []
    for rank in range(k):
        steps = [r for r in records if r.get("kind") == "step" and r.get("rank") == rank]
        compute = sum(r["compute_s"] for r in steps)
        idle = sum(r["wait_s"] for r in steps)
        stages.append(
            {
                "stage": rank,
                "layers": starts.get(rank, {}).get("layers"),
                "compute_s": compute,
                "idle_s": idle,
                "idle_share": idle / (compute + idle) if compute + idle > 0 else None,
                "peak_held_bytes": memory.get(rank),
            }
        )
    return {
        "schedule": parse_strategy(job.strategy).options["schedule"],
        "stages": k,
        "replicas": job.replicas,
        "microbatches": m,
        "balance": starts.get(0, {}).get("balance"),
        "checkpoint": job.checkpoint,
        "bubble_formula": (k - 1) / (m + k - 1),
        "per_stage": stages,
    }


def print_summary(summary: dict[str, Any]) -> None:
    """A short human-readable report of a run."""
    acc = summary["test_accuracy"]
    sps = summary["samples_per_sec"]
    workers = f"{summary['workers']} worker{'s' if summary['workers'] != 1 else ''}"
    print(
        f"paratrain train: {summary['model']} on {summary['dataset']}, {workers}, "
        f"{summary['strategy']}: test accuracy {acc:.4f}, {sps:,.0f} samples/s, wall time "
        f"{summary['wall_time_s']:.1f} s"
    )
    if summary.get("consensus_accuracy") is not None:
        print(
            f"  the workers' average model: test accuracy {summary['consensus_accuracy']:.4f} (consensus distance "
            f"{summary['consensus_distance']:.3g})"
        )
    pipe = summary.get("pipeline")
    if pipe is not None:
        print(
            f"  pipeline: {pipe['stages']} stages x {pipe['replicas']} replica{'s' if pipe['replicas'] != 1 else ''}, "
            f"{pipe['microbatches']} micro-batches, balance {pipe['balance']}; bubble formula (K-1)/(M+K-1) = "
            f"{pipe['bubble_formula']:.0%}"
        )
        for stage in pipe["per_stage"]:
            share = stage["idle_share"]
            held = stage["peak_held_bytes"]
            print(
                f"  stage {stage['stage']}: compute {stage['compute_s']:.2f} s, idle {stage['idle_s']:.2f} s "
                f"({'-' if share is None else f'{share:.0%}'}: bubble and waiting for activations/gradients), "
                f"peak activations held {'-' if held is None else f'{held / 1e6:.2f} MB'}"
            )
        print(f"  run directory: {summary['run_dir']} (metrics.jsonl, timeline.json, loss.png, accuracy.png)")
        return
    split = summary.get("tensor")
    if split is not None:
        layers = ", ".join(f"{name}={how}" for name, how in (split["splits"] or {}).items()) or "none"
        held = max(split["params_bytes_per_rank"].values(), default=0)
        share = split["params_share"]
        print(
            f"  split layers: {split['tensor']}-way tensor x {split['data']} data group"
            f"{'s' if split['data'] != 1 else ''} ({layers}); parameters per worker {held / 1e6:.2f} MB of the "
            f"model's {split['whole_params_bytes'] / 1e6:.2f} MB ({'-' if share is None else f'{share:.0%}'})"
        )
    for rank, entry in summary["per_rank"].items():
        total = entry["compute_s"] + entry["wait_s"]
        share = entry["wait_s"] / total if total else 0.0
        print(
            f"  rank {rank}: compute {entry['compute_s']:.2f} s, waiting for communication {entry['wait_s']:.2f} s "
            f"({share:.0%}), {entry['bytes_sent'] / 1e6:.1f} MB sent over sockets, "
            f"{entry['allreduce_bytes'] / 1e6:.1f} MB allreduced"
        )
    print(f"  run directory: {summary['run_dir']} (metrics.jsonl, timeline.json, loss.png, accuracy.png, summary.json)")
