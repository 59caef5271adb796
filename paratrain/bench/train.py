"""``paratrain bench train``: samples/s of paratrain's data parallelism next to DDP and one process.

In one command, on this machine, one engine after the other (so they never share the CPUs), repeated and
interleaved: ``single`` (one process, no communication — what parallelism must beat), ``paratrain``
(``DistributedOptimizer(strategy="allreduce")`` under ``paratrain launch``) and ``ddp`` (torch
``DistributedDataParallel`` over Gloo). Throughput = every worker's samples / the slowest worker's time.
Every engine's processes run through the launch library under one deadline (``--timeout``), their output
discarded (the workers write their numbers to JSON); see :mod:`.harness`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from paratrain.bench import harness
from paratrain.errors import ConfigError
from paratrain.launch.plan import free_port

__all__ = ["TrainBenchOptions", "run_train_bench"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBenchOptions:
    """What to measure."""

    model: str = "mlp"
    workers: int = 2
    steps: int = 200
    warmup: int = 20
    batch_size: int = 64
    repeat: int = 3
    timeout: float = 180.0

    def __post_init__(self) -> None:
        from paratrain.train.models import MODELS

        if self.model not in MODELS:
            raise ConfigError(f"unknown --model {self.model!r}; choose one of {', '.join(MODELS)}")
        harness.require_at_least_one(self, "workers", "steps", "batch_size", "repeat")
        if self.warmup < 0:
            raise ConfigError("--warmup must be >= 0")
        if self.timeout <= 0:
            raise ConfigError("--timeout must be positive")


def _worker(options: TrainBenchOptions, mode: str, out: str) -> list[str]:
    return [
        "-m", "paratrain.bench._train_worker", "--mode", mode, "--model", options.model, "--steps",
        str(options.steps), "--warmup", str(options.warmup), "--batch-size", str(options.batch_size), "--out", out,
    ]  # fmt: skip


def _throughput(out: str, mode: str, world: int) -> float:
    results = [json.loads(Path(out, f"{mode}-rank{r}.json").read_text()) for r in range(world)]
    return float(sum(r["steps"] * r["batch_size"] for r in results) / max(r["seconds"] for r in results))


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def _check(run: Callable[[TextIO], str | None]) -> None:
    """Runs an engine's job with its output discarded; raises RuntimeError saying what went wrong, if anything."""
    with open(os.devnull, "w", encoding="utf-8") as quiet:
        problem = run(quiet)
    if problem is not None:
        raise RuntimeError(problem)


def _run_commands(options: TrainBenchOptions, commands: Sequence[tuple[list[str], Mapping[str, str]]]) -> None:
    _check(lambda quiet: harness.run_job(commands, timeout=options.timeout, deadline_s=options.timeout, stdout=quiet))


def _run_single(options: TrainBenchOptions, out: str, threads: int) -> float:
    _run_commands(options, [([sys.executable, *_worker(options, "single", out)], _env(threads))])
    return _throughput(out, "single", 1)


def _run_single_all_cores(options: TrainBenchOptions, out: str) -> float:
    return _run_single(options, out, os.cpu_count() or 1)


def _run_single_one_thread(options: TrainBenchOptions, out: str) -> float:
    return _run_single(options, out, 1)


def _run_paratrain(options: TrainBenchOptions, out: str) -> float:
    cmd = ["python", *_worker(options, "paratrain", out)]
    _check(
        lambda quiet: harness.launch_job(
            cmd, nproc=options.workers, timeout=options.timeout, deadline_s=options.timeout, stdout=quiet
        )
    )
    return _throughput(out, "paratrain", options.workers)


def _run_ddp(options: TrainBenchOptions, out: str) -> float:
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // options.workers)
    world = {"WORLD_SIZE": str(options.workers), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    argv = [sys.executable, *_worker(options, "ddp", out)]
    _run_commands(options, [(argv, _env(threads) | world | {"RANK": str(r)}) for r in range(options.workers)])
    return _throughput(out, "ddp", options.workers)


def run_train_bench(options: TrainBenchOptions, *, out: TextIO | None = None) -> dict[str, Any]:
    """Measures every engine ``repeat`` times (interleaved) and returns medians and ratios."""
    stream = out or sys.stdout
    runs: dict[str, list[float]] = {"single": [], "single_1thread": [], "paratrain": [], "ddp": []}
    failures: list[str] = []
    engines = {
        "single": _run_single_all_cores,
        "single_1thread": _run_single_one_thread,
        "paratrain": _run_paratrain,
        "ddp": _run_ddp,
    }
    for round_ in range(options.repeat):
        for name, fn in engines.items():
            with tempfile.TemporaryDirectory(prefix="paratrain-bench-train-") as tmp:
                try:
                    rate = fn(options, tmp)
                except (RuntimeError, OSError, ValueError) as exc:
                    failures.append(f"round {round_ + 1} {name}: {type(exc).__name__}: {exc}")
                    print(f"  round {round_ + 1}/{options.repeat} {name:<10} FAILED ({exc})", file=stream, flush=True)
                    continue
            runs[name].append(rate)
            print(f"  round {round_ + 1}/{options.repeat} {name:<10} {rate:10,.0f} samples/s", file=stream, flush=True)
    # paratrain and the one-process anchor must succeed; an anchor from another project (DDP) may fail
    # (a Gloo run was seen to hang here): it is then reported as missing, with why, instead of sinking the run
    missing = [name for name in ("single", "single_1thread", "paratrain") if not runs[name]]
    if missing:
        raise RuntimeError(f"no successful run of {', '.join(missing)}: " + "; ".join(failures))
    medians: dict[str, float | None] = {
        name: statistics.median(values) if values else None for name, values in runs.items()
    }
    best_single = max(statistics.median(runs["single"]), statistics.median(runs["single_1thread"]))
    paratrain, ddp = statistics.median(runs["paratrain"]), medians["ddp"]
    return {
        "model": options.model,
        "workers": options.workers,
        "batch_size_per_worker": options.batch_size,
        "steps": options.steps,
        "samples_per_sec": medians,
        "runs": runs,
        "best_single_samples_per_sec": best_single,
        "paratrain_vs_single": paratrain / best_single,
        "paratrain_vs_ddp": paratrain / ddp if ddp else None,
        "ddp_vs_single": ddp / best_single if ddp else None,
        "cpu_count": os.cpu_count(),
        "failures": failures,
    }


def render(report: dict[str, Any]) -> str:
    """The comparison as a table."""
    rates = report["samples_per_sec"]
    lines = [
        f"{report['model']}, batch {report['batch_size_per_worker']} per worker, {report['workers']} workers, "
        f"{report['steps']} timed steps, median of {len(report['runs']['single'])} runs",
        f"{'engine':<34} {'samples/s':>10} {'vs best one process':>20}",
    ]
    labels = {
        "single": f"one process, {report['cpu_count']} threads",
        "single_1thread": "one process, 1 thread",
        "paratrain": "paratrain allreduce",
        "ddp": "torch DDP (Gloo)",
    }
    best = report["best_single_samples_per_sec"]
    for name in ("single", "single_1thread", "paratrain", "ddp"):
        rate = rates[name]
        if rate is None:
            lines.append(f"{labels[name]:<34} {'failed':>10} {'(see failures)':>20}")
        else:
            lines.append(f"{labels[name]:<34} {rate:10,.0f} {rate / best:19.2f}x")
    ratio = report["paratrain_vs_ddp"]
    lines.append(f"paratrain / DDP: {ratio:.2f}x" if ratio is not None else "paratrain / DDP: no DDP run succeeded")
    lines.extend(f"failed: {failure}" for failure in report["failures"])
    return "\n".join(lines)
