"""``paratrain bench train``: data-parallel efficiency of paratrain next to DDP, Horovod and one process.

In one command, on this machine, one engine after the other (so they never share the CPUs), repeated and
interleaved: ``single`` (one process, no communication), ``concurrent`` (as many one-thread processes as workers,
training at the same time with no communication at all: the same cores doing the same arithmetic, the physical
limit of data parallelism here), ``paratrain`` (``DistributedOptimizer(strategy="allreduce")`` under
``paratrain launch``), ``ddp`` (torch ``DistributedDataParallel`` over Gloo) and ``horovod`` (Horovod's
``DistributedOptimizer`` under ``horovodrun --gloo``, where Horovod is installed; see benchmarks/horovod for how
it builds against this torch). Workers run one thread each.

``--device cuda`` trains the model on the GPU(s) instead (rank r on GPU r modulo the GPUs there are: processes
share a GPU where there are fewer GPUs than workers): paratrain's allreduce then stages gradients through pinned
host memory in the background, or hands them to NCCL where every rank has a GPU of its own
(:mod:`paratrain.collectives.torch_engines`); DDP runs over Gloo with CUDA tensors and, where every rank has its own
GPU, over NCCL as well (``ddp_nccl``).

Throughput = every worker's samples / the slowest worker's time; for ``concurrent``, the sum of the processes'
own rates. **Data-parallel efficiency** = an engine's throughput / ``concurrent``'s. Each worker also reports
where its steps went (:mod:`._train_worker`): forward and backward, waiting for gradients, the update, and for
paratrain the shared-memory allreduce's copy in, reduce, copy out and waiting. Every engine's processes run
through the launch library under one deadline (``--timeout``), their output discarded (the workers write their
numbers to JSON); see :mod:`.harness`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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
    device: str = "cpu"

    def __post_init__(self) -> None:
        from paratrain.train.models import MODELS

        if self.model not in MODELS:
            raise ConfigError(f"unknown --model {self.model!r}; choose one of {', '.join(MODELS)}")
        harness.require_at_least_one(self, "workers", "steps", "batch_size", "repeat")
        if self.warmup < 0:
            raise ConfigError("--warmup must be >= 0")
        if self.timeout <= 0:
            raise ConfigError("--timeout must be positive")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: cpu or cuda")
        if self.device == "cuda" and cuda_devices() == 0:
            raise ConfigError("--device cuda, but torch sees no CUDA device here (torch.cuda.is_available() is False)")


def cuda_devices() -> int:
    """The CUDA devices torch sees (0 without torch's CUDA build or a GPU)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _worker(options: TrainBenchOptions, mode: str, out: str) -> list[str]:
    return [
        "-m", "paratrain.bench._train_worker", "--mode", mode, "--model", options.model, "--steps",
        str(options.steps), "--warmup", str(options.warmup), "--batch-size", str(options.batch_size), "--out", out,
        "--device", options.device,
    ]  # fmt: skip


def _results(out: str, mode: str, world: int) -> list[dict[str, Any]]:
    return [json.loads(Path(out, f"{mode}-rank{r}.json").read_text()) for r in range(world)]


def _throughput(out: str, mode: str, world: int) -> float:
    results = _results(out, mode, world)
    if mode == "concurrent":  # independent processes: each at its own rate
        return float(sum(r["steps"] * r["batch_size"] / r["seconds"] for r in results))
    return float(sum(r["steps"] * r["batch_size"] for r in results) / max(r["seconds"] for r in results))


def _breakdown(out: str, mode: str, world: int) -> dict[str, float]:
    """Milliseconds per step, averaged over the workers: compute, wait, apply, and the shm phases."""
    results = _results(out, mode, world)
    steps = results[0]["steps"]
    keys = ["compute_s", "wait_s", "apply_s"]
    parts = {k.removesuffix("_s"): 1e3 * statistics.mean(r[k] for r in results) / steps for k in keys}
    phases = [r.get("shm_phases_s") or {} for r in results]
    for name in ("copy_in", "reduce", "copy_out", "wait"):
        if all(name in p for p in phases):
            parts[f"allreduce_{name}"] = 1e3 * statistics.mean(p[name] for p in phases) / steps
    parts["step"] = 1e3 * statistics.mean(r["seconds"] for r in results) / steps
    return parts


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


def _run_concurrent(options: TrainBenchOptions, out: str) -> float:
    n = options.workers
    argv = [sys.executable, *_worker(options, "concurrent", out)]
    bench = {"PARATRAIN_BENCH_WORLD": str(n)}
    _run_commands(options, [(argv, _env(1) | bench | {"PARATRAIN_BENCH_RANK": str(r)}) for r in range(n)])
    return _throughput(out, "concurrent", n)


def _run_paratrain(options: TrainBenchOptions, out: str) -> float:
    cmd = ["python", *_worker(options, "paratrain", out)]
    _check(
        lambda quiet: harness.launch_job(
            cmd, nproc=options.workers, timeout=options.timeout, deadline_s=options.timeout, stdout=quiet
        )
    )
    return _throughput(out, "paratrain", options.workers)


def _run_ddp(options: TrainBenchOptions, out: str, backend: str = "gloo") -> float:
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // options.workers)
    world = {"WORLD_SIZE": str(options.workers), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    argv = [sys.executable, *_worker(options, "ddp", out), "--ddp-backend", backend]
    _run_commands(options, [(argv, _env(threads) | world | {"RANK": str(r)}) for r in range(options.workers)])
    return _throughput(out, "ddp", options.workers)


def _run_ddp_nccl(options: TrainBenchOptions, out: str) -> float:
    return _run_ddp(options, out, "nccl")


def nccl_missing(options: TrainBenchOptions) -> str | None:
    """None when DDP over NCCL can run ``options.workers`` ranks here, else why not."""
    import torch.distributed as dist

    if options.device != "cuda":
        return "the model is on the CPU (--device cuda measures it)"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    gpus = cuda_devices()
    if gpus < options.workers:
        return f"NCCL needs a GPU per rank: {gpus} GPU(s) for {options.workers} workers"
    return None


def horovod_available() -> str | None:
    """None when Horovod's PyTorch API and ``horovodrun`` are installed here, else why not."""
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed (benchmarks/horovod/build.sh builds it against this torch)"
    if shutil.which("horovodrun") is None and not Path(sys.executable).with_name("horovodrun").exists():
        return "horovodrun is not on PATH"
    return None


def _run_horovod(options: TrainBenchOptions, out: str) -> float:
    n = options.workers
    runner = shutil.which("horovodrun") or str(Path(sys.executable).with_name("horovodrun"))
    argv = [runner, "-np", str(n), "-H", f"localhost:{n}", "--gloo", sys.executable, *_worker(options, "horovod", out)]
    _run_commands(options, [(argv, _env(1) | {"HOROVOD_CPU_OPERATIONS": "gloo"})])
    return _throughput(out, "horovod", n)


_NO_BREAKDOWN = frozenset({"single", "single_1thread"})  # one process: nothing to break down


def run_train_bench(options: TrainBenchOptions, *, out: TextIO | None = None) -> dict[str, Any]:
    """Measures every engine ``repeat`` times (interleaved) and returns medians, efficiencies and breakdowns."""
    stream = out or sys.stdout
    engines: dict[str, Callable[[TrainBenchOptions, str], float]] = {
        "single": _run_single_all_cores,
        "single_1thread": _run_single_one_thread,
        "concurrent": _run_concurrent,
        "paratrain": _run_paratrain,
        "ddp": _run_ddp,
    }
    if options.device == "cuda":
        nccl = nccl_missing(options)
        if nccl is None:
            engines["ddp_nccl"] = _run_ddp_nccl
        else:
            print(f"  ddp over nccl: not measured: {nccl}", file=stream, flush=True)
    horovod_missing = horovod_available() if options.device == "cpu" else "the CUDA model (Horovod is built CPU-only)"
    if horovod_missing is None:
        engines["horovod"] = _run_horovod
    else:
        print(f"  horovod: not measured: {horovod_missing}", file=stream, flush=True)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    breakdowns: dict[str, list[dict[str, float]]] = {name: [] for name in engines if name not in _NO_BREAKDOWN}
    failures: list[str] = []
    for round_ in range(options.repeat):
        for name, fn in engines.items():
            with tempfile.TemporaryDirectory(prefix="paratrain-bench-train-") as tmp:
                try:
                    rate = fn(options, tmp)
                    if name in breakdowns:
                        mode = "ddp" if name == "ddp_nccl" else name  # (the worker's files are named by mode)
                        breakdowns[name].append(_breakdown(tmp, mode, options.workers))
                except (RuntimeError, OSError, ValueError) as exc:
                    failures.append(f"round {round_ + 1} {name}: {type(exc).__name__}: {exc}")
                    print(f"  round {round_ + 1}/{options.repeat} {name:<14} FAILED ({exc})", file=stream, flush=True)
                    continue
            runs[name].append(rate)
            print(f"  round {round_ + 1}/{options.repeat} {name:<14} {rate:10,.0f} samples/s", file=stream, flush=True)
    # paratrain and the no-communication anchors must succeed; an anchor from another project (DDP, Horovod)
    # may fail (a Gloo run was seen to hang here): it is then reported as missing, with why
    missing = [name for name in ("single", "single_1thread", "concurrent", "paratrain") if not runs[name]]
    if missing:
        raise RuntimeError(f"no successful run of {', '.join(missing)}: " + "; ".join(failures))
    medians: dict[str, float | None] = {
        name: statistics.median(values) if values else None for name, values in runs.items()
    }
    best_single = max(statistics.median(runs["single"]), statistics.median(runs["single_1thread"]))
    limit = statistics.median(runs["concurrent"])
    paratrain, ddp = statistics.median(runs["paratrain"]), medians["ddp"]
    efficiency = {
        name: (rate / limit if rate is not None else None)
        for name, rate in medians.items()
        if name in ("paratrain", "ddp", "ddp_nccl", "horovod")
    }
    return {
        "model": options.model,
        "device": options.device,
        "workers": options.workers,
        "batch_size_per_worker": options.batch_size,
        "steps": options.steps,
        "samples_per_sec": medians,
        "runs": runs,
        "best_single_samples_per_sec": best_single,
        "data_parallel_efficiency": efficiency,
        "efficiency_spread": {
            name: [min(runs[name]) / limit, max(runs[name]) / limit] for name in efficiency if runs[name]
        },
        "breakdown_ms_per_step": {
            name: {key: statistics.median(b[key] for b in rows) for key in rows[0]}
            for name, rows in breakdowns.items()
            if rows
        },
        "paratrain_vs_single": paratrain / best_single,
        "paratrain_vs_ddp": paratrain / ddp if ddp else None,
        "ddp_vs_single": ddp / best_single if ddp else None,
        "horovod": horovod_missing or "measured",
        "cpu_count": os.cpu_count(),
        "failures": failures,
    }


def render(report: dict[str, Any]) -> str:
    """The comparison as a table: samples/s, efficiency, and where each engine's step goes."""
    rates = report["samples_per_sec"]
    lines = [
        f"{report['model']} on {report.get('device', 'cpu')}, batch {report['batch_size_per_worker']} per worker, "
        f"{report['workers']} workers, "
        f"{report['steps']} timed steps, median of {len(report['runs']['single'])} runs",
        f"{'engine':<40} {'samples/s':>10} {'efficiency':>11} {'vs best one process':>20}",
    ]
    labels = {
        "single": f"one process, {report['cpu_count']} threads",
        "single_1thread": "one process, 1 thread",
        "concurrent": f"{report['workers']} processes, no communication",
        "paratrain": "paratrain allreduce",
        "ddp": "torch DDP (Gloo)",
        "ddp_nccl": "torch DDP (NCCL)",
        "horovod": "Horovod (Gloo)",
    }
    best = report["best_single_samples_per_sec"]
    efficiency = report["data_parallel_efficiency"]
    for name, label in labels.items():
        if name not in rates:
            continue
        rate = rates[name]
        eff = efficiency.get(name)
        eff_text = f"{eff:11.2f}" if eff is not None else ("       1.00" if name == "concurrent" else " " * 11)
        if rate is None:
            lines.append(f"{label:<40} {'failed':>10} {'':>11} {'(see failures)':>20}")
        else:
            lines.append(f"{label:<40} {rate:10,.0f} {eff_text} {rate / best:19.2f}x")
    if report["horovod"] != "measured":
        lines.append(f"Horovod: not measured ({report['horovod']})")
    lines.append("")
    lines.append("ms per step (median of rounds, mean of workers)")
    keys = ["step", "compute", "wait", "apply", "allreduce_copy_in", "allreduce_reduce", "allreduce_copy_out",
            "allreduce_wait"]  # fmt: skip
    lines.append(f"{'engine':<16}" + "".join(f"{k.replace('allreduce_', 'ar.'):>12}" for k in keys))
    for name, parts in report["breakdown_ms_per_step"].items():
        lines.append(f"{name:<16}" + "".join(f"{parts[k]:12.3f}" if k in parts else f"{'':>12}" for k in keys))
    ratio = report["paratrain_vs_ddp"]
    lines.append(f"paratrain / DDP: {ratio:.2f}x" if ratio is not None else "paratrain / DDP: no DDP run succeeded")
    lines.extend(f"failed: {failure}" for failure in report["failures"])
    return "\n".join(lines)
