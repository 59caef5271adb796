"""``paratrain bench soap``: paratrain's tensor parallelism vs torch's ``parallelize_module`` vs one process.

In one command, on the same model, split and mini-batches, one engine after the other (they never share the
cores), repeated in interleaved rounds (``--repeat``; median and min-max reported):

* ``single``: the whole model in one single-threaded process;
* ``paratrain``: :func:`paratrain.torch.soap.parallelize`, N single-threaded processes under ``paratrain launch``;
* ``torch``: ``torch.distributed.tensor.parallel.parallelize_module`` (``ColwiseParallel``/``RowwiseParallel``,
  a CPU device mesh over Gloo), N single-threaded processes.

Both split Megatron-LM's way (:func:`paratrain.bench._soap_worker.megatron_pairs`). An engine whose first losses
differ from one process's (relative 1e-4, float32 sums in another order) is reported as failed, never timed. The
step time is the slowest rank's median; the parameter bytes are read from each rank's tensors.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paratrain.bench import harness, tables
from paratrain.bench.harness import EngineRun, Step
from paratrain.bench.machine import MachineSample, OthersMeter, machine_report
from paratrain.bench.stats import ratio
from paratrain.errors import ConfigError
from paratrain.launch.plan import free_port

__all__ = ["SoapBenchOptions", "render", "run_bench", "summarize"]

LOSS_RTOL = 1e-4


@dataclass(frozen=True, slots=True, kw_only=True)
class SoapBenchOptions:
    """What to measure; validated at once (:class:`ConfigError` names the flag)."""

    model: str = "widemlp"
    tensor: tuple[int, ...] = (2, 4)
    batch_size: int = 64
    steps: int = 20
    warmup: int = 3
    torch: bool = True
    repeat: int = 3
    timeout: float = 300.0

    def __post_init__(self) -> None:
        from paratrain.bench._soap_worker import CHECKED_STEPS
        from paratrain.train.models import MODEL_KINDS, MODELS

        if self.model not in MODELS or MODEL_KINDS.get(self.model) == "text":
            raise ConfigError(f"unknown --model {self.model!r}; choose an image model: mlp, widemlp, deepmlp, lenet")
        if not self.tensor or min(self.tensor) < 2:
            raise ConfigError(f"--tensor must be at least 2 (one is the one-process engine), got {list(self.tensor)}")
        harness.require_at_least_one(self, "batch_size", "steps", "repeat")
        if self.warmup < CHECKED_STEPS:
            raise ConfigError(f"--warmup must be at least {CHECKED_STEPS}: the first steps' losses are checked")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be positive, got {self.timeout}")


def label(engine: str, model: str, tensor: int = 1) -> str:
    """An engine's result name, e.g. ``paratrain-widemlp-t2`` or ``single-widemlp``."""
    return f"single-{model}" if engine == "single" else f"{engine}-{model}-t{tensor}"


def summarize(label_: str, payloads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One engine's run: the slowest rank's median step, and each rank's parameter bytes."""
    return {
        "engine": label_,
        "step_ms": 1e3 * max(statistics.median(p["times"]) for p in payloads),
        "parameter_bytes": [int(p["parameter_bytes"]) for p in sorted(payloads, key=lambda p: int(p["rank"]))],
    }


def combine(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """An engine's rounds merged: the median step, every round's kept."""
    steps = [float(r["step_ms"]) for r in rounds]
    return {**rounds[0], "step_ms": statistics.median(steps), "step_ms_runs": steps}


def _verified(run: EngineRun, reference: Sequence[float]) -> EngineRun:
    if run.status != "ok":
        return run
    for p in run.payloads:
        got = p.get("losses", [])
        if len(got) != len(reference) or any(
            abs(a - b) > LOSS_RTOL * abs(b) for a, b in zip(got, reference, strict=False)
        ):
            return EngineRun("error", f"rank {p['rank']}'s first losses {got} are not one process's {list(reference)}")
    return run


def _run_engine(
    options: SoapBenchOptions, engine: str, tensor: int, out: str, *, reference: Sequence[float]
) -> dict[str, EngineRun]:
    name = label(engine, options.model, tensor)
    cmd = [
        "-m", "paratrain.bench._soap_worker", "--engine", engine, "--label", name, "--model", options.model,
        "--tensor", str(tensor), "--batch-size", str(options.batch_size), "--steps", str(options.steps),
        "--warmup", str(options.warmup), "--out", out, "--deadline", str(max(options.timeout - harness.GRACE_S, 1.0)),
    ]  # fmt: skip
    deadline = options.timeout + 2 * harness.GRACE_S
    count = 1 if engine == "single" else tensor
    with open(os.devnull, "w", encoding="utf-8") as quiet:
        if engine == "paratrain":
            problem = harness.launch_job(
                ["python", *cmd], nproc=tensor, timeout=options.timeout, deadline_s=deadline, stdout=quiet
            )
        else:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            if engine == "torch":
                env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(count)})
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            commands = [([sys.executable, *cmd], {**env, "RANK": str(r)}) for r in range(count)]
            problem = harness.run_job(commands, timeout=options.timeout, deadline_s=deadline, stdout=quiet)
    judged = harness.judge({name: harness.collect(out, name, count)}, problem)
    return {name: _verified(judged[name], reference)}


def _steps(options: SoapBenchOptions, reference: Sequence[float]) -> list[Step]:
    m, b = options.model, options.batch_size
    run = functools.partial(_run_engine, options, reference=reference)
    steps = [Step((label("single", m),), f"one process, {m}, batch {b}", functools.partial(run, "single", 1))]
    for tensor in options.tensor:
        for engine in ("paratrain", *(["torch"] if options.torch else [])):
            what = "paratrain soap" if engine == "paratrain" else "torch parallelize_module"
            steps.append(
                Step(
                    (label(engine, m, tensor),),
                    f"{what}, {m}, {tensor}-way, batch {b}",
                    functools.partial(run, engine, tensor),
                )
            )
    return steps


def run_bench(options: SoapBenchOptions, *, say: Any = None) -> tuple[dict[str, Any], int]:
    """Checks the reference, runs every engine ``repeat`` times interleaved; the report and the exit code (1 if an
    engine failed or disagreed)."""
    import datetime

    from paratrain.bench._soap_worker import build, megatron_pairs, one_process_losses

    speak = say or (lambda line: print(line, flush=True))
    before = MachineSample.take()
    reference = one_process_losses(options.model, options.batch_size)
    whole = build(options.model)
    meter = OthersMeter()
    rounds = harness.run_rounds(
        _steps(options, reference),
        repeat=options.repeat,
        summarize=lambda name, payloads: [summarize(name, payloads)],
        say=speak,
        tmp_prefix="paratrain-bench-soap-",
    )
    report = {
        "benchmark": "soap",
        "model": options.model,
        "tensor": list(options.tensor),
        "splits": {str(t): megatron_pairs(whole, t) for t in options.tensor},
        "batch_size": options.batch_size,
        "steps": options.steps,
        "warmup": options.warmup,
        "repeat": options.repeat,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_report(before, {"others_busy_during": meter.fraction()}),
        "inputs": "synthetic: uniform [0, 1) 1x28x28 images, uniform labels of 10 classes, 4 mini-batches cycled",
        "reference_losses": reference,
        "engines": rounds.engines,
        "results": {name: combine([run[0] for run in runs]) for name, runs in rounds.rows.items()},
    }
    return report, harness.exit_code(rounds.engines)


DEFINITIONS = [
    "ms/step    forward + backward + SGD step: the slowest rank's median over the timed steps; median (min-max)",
    "           of the runs",
    "torch/pt   torch parallelize_module's ms/step / paratrain's on the same split (> 1: paratrain faster)",
    "params     the bytes of the parameters each rank holds (read from its tensors), largest rank; / 1 proc",
]


def render(report: Mapping[str, Any]) -> str:
    """The step-time and memory table, with the column definitions and what failed."""
    results, model = report["results"], report["model"]
    single = results.get(label("single", model))
    lines = [
        f"tensor parallelism, {model}, batch {report['batch_size']}, {report['steps']} timed steps after "
        f"{report['warmup']} warm-up, {report['repeat']} interleaved run(s); every process single-threaded",
        f"{tables.cpus(report['machine'])}; {tables.load(report['machine'])}",
        "",
        "| engine | N | ms/step | torch/pt | params (largest rank) | / 1 proc |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, engine: str, n: int, versus: float | None) -> str:
        r = results.get(name)
        if r is None:
            return f"| {engine} | {n} | - | - | - | - |"
        runs = r.get("step_ms_runs", [r["step_ms"]])
        biggest = max(r["parameter_bytes"])
        share = ratio(biggest, max(single["parameter_bytes"])) if single else None
        return (
            f"| {engine} | {n} | {r['step_ms']:.2f} ({min(runs):.2f}-{max(runs):.2f}) | "
            f"{'-' if versus is None else f'{versus:.2f}'} | {biggest / 1024:,.0f} KiB | "
            f"{'-' if share is None else share} |"
        )

    lines.append(row(label("single", model), "one process", 1, None))
    for t in report["tensor"]:
        ours, theirs = results.get(label("paratrain", model, t)), results.get(label("torch", model, t))
        versus = ratio(theirs["step_ms"], ours["step_ms"]) if ours and theirs else None
        lines.append(row(label("paratrain", model, t), "paratrain soap", t, versus))
        lines.append(row(label("torch", model, t), "torch parallelize_module", t, None))
    lines += tables.footer(report, DEFINITIONS, busy=report["machine"].get("others_busy_during"), when="during the run")
    return "\n".join(lines)
