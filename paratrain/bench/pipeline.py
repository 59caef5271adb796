"""``paratrain bench pipeline``: paratrain's ``Pipe`` vs torch.distributed.pipelining vs one process, trained alike.

In one command, on the same model, stages K, micro-batches M, mini-batches and steps, one engine after the other
(so they never share the cores), repeated in interleaved rounds (``--repeat``; median and min-max reported):

* ``single``: the whole model in one single-threaded process, the same micro-batch loop (each micro-batch's
  summed loss back-propagated in turn, one optimizer step): what a pipeline must beat;
* ``paratrain``: :class:`paratrain.torch.pipeline.Pipe`, K single-threaded processes under ``paratrain launch``,
  once per schedule; its ``trace=`` spans give every stage's idle time (the bubble) and compute time;
* ``torch``: ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``, Gloo,
  ``scale_grads=False``), K single-threaded processes, the same split, loss and optimizer.

The split is computed once here, from :func:`paratrain.torch.profile.profile_layers` on one micro-batch and
:func:`paratrain.pipeline.partition.partition` (or ``--balance``), and given to both pipelines, so that they
differ only by their runtime. Before anything is timed, this process trains the model for a few steps the
one-process way; an engine whose losses of those steps differ (relative 1e-5) is reported as failed, never timed.

Why the bubble is measured per stage as idle time over the step's wall time: that is what the theory
(K - 1)/(M + K - 1) predicts for every stage when all stages take equal time and communication is free; the
measured compute imbalance (slowest stage / mean) is printed beside it, since it is the first reason to differ.

The pure measures (:func:`idle_fraction`, :func:`check_losses`, ...) sit at the top and need no torch.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paratrain.bench import harness, tables
from paratrain.bench.harness import EngineRun, Step
from paratrain.bench.machine import MachineSample, OthersMeter, machine_report
from paratrain.errors import ConfigError
from paratrain.launch.plan import free_port

__all__ = [
    "SCHEDULES",
    "PipelineBenchOptions",
    "check_losses",
    "idle_fraction",
    "imbalance",
    "render",
    "run_bench",
    "summarize",
    "theory_bubble",
]

#: The schedules both pipelines have (PipeDream has no torch counterpart and another update rule).
SCHEDULES = ("gpipe", "1f1b")
#: How far an engine's loss may be from one process's (relative) before it is refused.
LOSS_RTOL = 1e-5
#: The issue's targets.
TARGET_VS_TORCH, TARGET_VS_SINGLE, TARGET_BUBBLE, TARGET_IMBALANCE = 1.5, 1.6, 0.10, 1.10


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineBenchOptions:
    """What to measure; validated at once (:class:`ConfigError` names the flag)."""

    models: tuple[str, ...] = ("mlp",)
    stages: tuple[int, ...] = (2,)
    microbatches: int = 8
    batch_size: int = 256
    steps: int = 30
    warmup: int = 5
    schedules: tuple[str, ...] = SCHEDULES
    torch: bool = True
    balance: tuple[int, ...] | None = None
    repeat: int = 3
    timeout: float = 300.0

    def __post_init__(self) -> None:
        from paratrain.bench._pipeline_worker import CHECKED_STEPS
        from paratrain.train.models import MODELS

        bad = [m for m in self.models if m not in MODELS]
        if bad or not self.models:
            raise ConfigError(f"unknown --model {','.join(bad)!r}; choose from {', '.join(MODELS)}")
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise ConfigError(f"unknown --schedules {','.join(bad)!r}; choose from {', '.join(SCHEDULES)}")
        if not self.stages or min(self.stages) < 2:
            raise ConfigError(f"--stages must be at least 2 (one stage is the one-process engine), got {self.stages}")
        harness.require_at_least_one(self, "microbatches", "batch_size", "steps", "repeat")
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"--batch-size {self.batch_size} must be a multiple of --microbatches {self.microbatches} "
                "(equal micro-batches: both pipelines then cut the mini-batch the same way)"
            )
        if self.warmup < CHECKED_STEPS:
            raise ConfigError(f"--warmup must be at least {CHECKED_STEPS}: the first steps' losses are checked")
        if self.timeout <= 0:
            raise ConfigError(f"--timeout must be positive, got {self.timeout}")
        if self.balance is not None and (len(self.stages) != 1 or len(self.balance) != self.stages[0]):
            raise ConfigError(f"--balance needs one --stages value and one layer count per stage, got {self.balance}")


# -- pure measures ---------------------------------------------------------------------------------------------


def theory_bubble(stages: int, microbatches: int) -> float:
    """(K - 1)/(M + K - 1): every stage's idle share of a GPipe or 1F1B step with equal stages and free
    communication.

    Example:
        >>> round(theory_bubble(2, 8), 4), theory_bubble(4, 1)
        (0.1111, 0.75)
    """
    return (stages - 1) / (microbatches + stages - 1)


Span = Sequence[Any]  # (name, category, start, end)


def _step_window(spans: Sequence[Span]) -> tuple[float, float]:
    for _name, category, start, end in spans:
        if category == "step":
            return float(start), float(end)
    raise ValueError("a step's spans need one ('step', 'step', start, end) span: the step's wall time")


def compute_seconds(spans: Sequence[Span]) -> float:
    """Seconds of ``compute`` spans inside the step's window (clipped to it).

    Example:
        >>> compute_seconds([("forward 0", "compute", 0.0, 1.0), ("step", "step", 0.5, 4.0)])
        0.5
    """
    lo, hi = _step_window(spans)
    return float(sum(max(0.0, min(end, hi) - max(start, lo)) for _, cat, start, end in spans if cat == "compute"))


def idle_fraction(spans: Sequence[Span]) -> float:
    """The share of one step's wall time a stage did not compute: 1 - compute / wall.

    Waiting for a message, the sends' completion and the Python between steps all count as idle: the bubble as
    the stage experiences it.

    Example:
        >>> idle_fraction([("forward 0", "compute", 0.0, 1.0), ("wait gradient 0", "waiting", 1.0, 2.0),
        ...                ("backward 0", "compute", 2.0, 4.0), ("step", "step", 0.0, 4.0)])
        0.25
    """
    lo, hi = _step_window(spans)
    return 1.0 - compute_seconds(spans) / (hi - lo) if hi > lo else 0.0


def imbalance(times: Sequence[float]) -> float:
    """Slowest / mean: 1.0 for perfectly balanced stages; the pipeline runs at the slowest one's pace.

    Example:
        >>> imbalance([1.0, 3.0])
        1.5
    """
    mean = statistics.fmean(times)
    return max(times) / mean if mean > 0 else 1.0


def check_losses(losses: Sequence[float], reference: Sequence[float], *, rtol: float = LOSS_RTOL) -> str | None:
    """Why an engine's first losses disagree with one process's, or None when they agree to ``rtol``.

    Example:
        >>> check_losses([10.0, 9.0], [10.0, 9.00001]) is None, check_losses([10.0], [10.0, 9.0])
        (True, 'reported 1 losses, one process 2')
    """
    if len(losses) != len(reference):
        return f"reported {len(losses)} losses, one process {len(reference)}"
    for i, (got, want) in enumerate(zip(losses, reference, strict=True)):
        if abs(got - want) > rtol * max(abs(want), 1e-30):
            return f"step {i + 1} loss {got:.8g} differs from one process's {want:.8g} (relative {rtol:g}): refused"
    return None


def summarize(label: str, payloads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One engine's run: throughput from the slowest rank, and per stage (rank) its idle share, compute time and
    memory (medians over the timed steps)."""
    slowest = max(float(p["seconds"]) for p in payloads)
    first = payloads[0]
    steps, batch = int(first["steps"]), int(first["batch_size"])
    stages = []
    for p in sorted(payloads, key=lambda p: int(p["stage"])):
        stage: dict[str, Any] = {
            "stage": int(p["stage"]),
            "step_ms": 1e3 * statistics.median(p["step_walls"]),
            "rss_growth_bytes": max(0, int(p["rss_peak_bytes"]) - int(p["rss_base_bytes"])),
            "held_bytes": p.get("held_bytes"),
            "held_bytes_checkpoint": p.get("held_bytes_checkpoint"),
        }
        if p.get("spans"):
            stage["idle"] = statistics.median(idle_fraction(s) for s in p["spans"])
            stage["compute_ms"] = 1e3 * statistics.median(compute_seconds(s) for s in p["spans"])
        stages.append(stage)
    return {
        "engine": label,
        "samples_per_s": steps * batch / slowest,
        "step_ms": 1e3 * slowest / steps,
        "stages": stages,
    }


def combine(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """An engine's rounds merged: the median of every number, with the throughput's min and max kept."""
    rates = [r["samples_per_s"] for r in rounds]
    merged: dict[str, Any] = {
        "engine": rounds[0]["engine"],
        "samples_per_s": statistics.median(rates),
        "samples_per_s_runs": rates,
        "step_ms": statistics.median(r["step_ms"] for r in rounds),
        "stages": [],
    }
    for index, stage in enumerate(rounds[0]["stages"]):
        row = dict(stage)
        for key, value in stage.items():
            if key != "stage" and isinstance(value, (int, float)):
                row[key] = statistics.median(r["stages"][index][key] for r in rounds)
        merged["stages"].append(row)
    return merged


# -- running ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    """One (model, K) with its split: ``balance`` layers per stage, the partitioner's per-stage times."""

    model: str
    stages: int
    balance: tuple[int, ...]
    predicted_s: tuple[float, ...] = field(default=())
    input_bytes: tuple[int, ...] = field(default=())

    @property
    def key(self) -> str:
        return f"{self.model}-k{self.stages}"


def label(engine: str, model: str, schedule: str = "", stages: int = 1) -> str:
    """An engine's result name, e.g. ``paratrain-gpipe-mlp-k2`` or ``single-mlp`` (a file name: no slashes)."""
    return f"single-{model}" if engine == "single" else f"{engine}-{schedule}-{model}-k{stages}"


def plan_case(options: PipelineBenchOptions, model: str, stages: int) -> Case:
    """Profiles every layer on one micro-batch here (one thread, as the stages run) and splits them."""
    import torch

    from paratrain.bench._pipeline_worker import make_batches, model_layers
    from paratrain.pipeline.partition import partition, stage_time
    from paratrain.torch.profile import profile_layers

    torch.set_num_threads(1)
    layers = model_layers(model)
    if len(layers) < stages:
        raise ConfigError(f"{model} has {len(layers)} layers: it cannot fill {stages} stages")
    sample = make_batches(model, options.batch_size)[0][0][: options.batch_size // options.microbatches]
    costs = profile_layers(layers, sample)
    if options.balance is not None:
        if sum(options.balance) != len(layers) or min(options.balance) < 1:
            raise ConfigError(f"--balance {list(options.balance)} must split all {len(layers)} layers of {model}")
        balance = tuple(options.balance)
    else:
        balance = partition(costs, stages).balance
    bounds = [(sum(balance[:s]), sum(balance[: s + 1])) for s in range(stages)]
    times = tuple(stage_time(costs, a, b, bandwidth=float("inf"), last=True) for a, b in bounds)
    inputs = tuple(
        sample.numel() * sample.element_size() if a == 0 else costs[a - 1].activation_bytes for a, _ in bounds
    )
    return Case(model, stages, balance, times, inputs)


def reference_losses(options: PipelineBenchOptions, model: str) -> list[float]:
    """The first steps' summed losses of one process, computed here: what every engine must reproduce."""
    from torch import nn

    from paratrain.bench._pipeline_worker import (
        CHECKED_STEPS,
        make_batches,
        model_layers,
        one_process_step,
        optimizer_for,
    )

    net = nn.Sequential(*model_layers(model))
    opt = optimizer_for(list(net.parameters()))
    batches = make_batches(model, options.batch_size)[:CHECKED_STEPS]
    return [one_process_step(net, opt, x, y, options.microbatches) for x, y in batches]


def _worker_cmd(
    options: PipelineBenchOptions, engine: str, name: str, case: Case, out: str, *, schedule: str
) -> list[str]:
    model, balance = case.model, case.balance
    return [
        "-m", "paratrain.bench._pipeline_worker", "--engine", engine, "--label", name, "--model", model,
        "--schedule", schedule, "--balance", ",".join(map(str, balance)), "--microbatches", str(options.microbatches),
        "--batch-size", str(options.batch_size), "--steps", str(options.steps), "--warmup", str(options.warmup),
        "--out", out, "--deadline", str(max(options.timeout - harness.GRACE_S, 1.0)),
    ]  # fmt: skip


def _one_thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _verified(run: EngineRun, reference: Sequence[float]) -> EngineRun:
    """The run, or an error if the rank with the losses (the last stage) disagrees with one process."""
    if run.status != "ok":
        return run
    losses: list[float] = next((p["losses"] for p in run.payloads if p.get("losses")), [])
    why = check_losses(losses, reference)
    return run if why is None else EngineRun("error", why)


def _run_engine(
    options: PipelineBenchOptions,
    engine: str,
    case: Case,
    out: str,
    *,
    schedule: str,
    reference: Sequence[float],
) -> dict[str, EngineRun]:
    name = label(engine, case.model, schedule, case.stages)
    cmd = _worker_cmd(options, engine, name, case, out, schedule=schedule)
    deadline = options.timeout + 2 * harness.GRACE_S
    with open(os.devnull, "w", encoding="utf-8") as quiet:
        if engine == "paratrain":
            problem = harness.launch_job(
                ["python", *cmd], nproc=case.stages, timeout=options.timeout, deadline_s=deadline, stdout=quiet
            )
            count = case.stages
        else:
            count = 1 if engine == "single" else case.stages
            env = _one_thread()
            if engine == "torch":
                env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(count)})
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            commands = [([sys.executable, *cmd], {**env, "RANK": str(r)}) for r in range(count)]
            problem = harness.run_job(commands, timeout=options.timeout, deadline_s=deadline, stdout=quiet)
    judged = harness.judge({name: harness.collect(out, name, count, who="stage")}, problem)
    return {name: _verified(judged[name], reference)}


def _steps(options: PipelineBenchOptions, cases: Sequence[Case], references: Mapping[str, list[float]]) -> list[Step]:
    steps = []
    m, b = options.microbatches, options.batch_size
    for model in options.models:
        ref = references[model]
        single = functools.partial(_run_engine, options, "single", Case(model, 1, (0,)), schedule="", reference=ref)
        steps.append(Step((label("single", model),), f"one process, {model}, M={m}, batch {b}", single))
        for case in (c for c in cases if c.model == model):
            for schedule in options.schedules:
                for engine in ("paratrain", *(["torch"] if options.torch else [])):
                    run = functools.partial(_run_engine, options, engine, case, schedule=schedule, reference=ref)
                    what = "paratrain Pipe" if engine == "paratrain" else "torch.distributed.pipelining"
                    steps.append(
                        Step(
                            (label(engine, model, schedule, case.stages),),
                            f"{what} {schedule}, {model}, K={case.stages}, M={m}, balance {list(case.balance)}",
                            run,
                        )
                    )
    return steps


def run_bench(options: PipelineBenchOptions, *, say: Any = None) -> tuple[dict[str, Any], int]:
    """Plans every split, checks the reference, runs every engine ``repeat`` times interleaved; the report and
    the exit code (1 if an engine failed or disagreed)."""
    import datetime

    speak = say or (lambda line: print(line, flush=True))
    before = MachineSample.take()
    cases = []
    for model in options.models:
        for k in options.stages:
            case = plan_case(options, model, k)
            speak(f"split {model} into {k} stages: balance {list(case.balance)}")
            cases.append(case)
    references = {model: reference_losses(options, model) for model in options.models}
    meter = OthersMeter()
    rounds = harness.run_rounds(
        _steps(options, cases, references),
        repeat=options.repeat,
        summarize=lambda name, payloads: [summarize(name, payloads)],
        say=speak,
        tmp_prefix="paratrain-bench-pipeline-",
    )
    results = {name: combine([run[0] for run in runs]) for name, runs in rounds.rows.items()}
    report = {
        "benchmark": "pipeline",
        "models": list(options.models),
        "stages": list(options.stages),
        "microbatches": options.microbatches,
        "batch_size": options.batch_size,
        "steps": options.steps,
        "warmup": options.warmup,
        "schedules": list(options.schedules),
        "repeat": options.repeat,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_report(before, {"others_busy_during": meter.fraction()}),
        "inputs": "synthetic: uniform [0, 1) 1x28x28 images, uniform labels of 10 classes, 4 mini-batches cycled",
        "reference_losses": references,
        "cases": [
            {
                "model": c.model,
                "stages": c.stages,
                "balance": list(c.balance),
                "predicted_stage_s": list(c.predicted_s),
                "predicted_imbalance": imbalance(c.predicted_s),
                "input_bytes": list(c.input_bytes),
            }
            for c in cases
        ],
        "engines": rounds.engines,
        "results": results,
    }
    return report, harness.exit_code(rounds.engines)


# -- the tables -------------------------------------------------------------------------------------------------

_ENGINE_NAMES = {"single": "one process", "paratrain": "paratrain Pipe", "torch": "torch pipelining"}

DEFINITIONS = [
    "samples/s  mini-batch samples x timed steps / the slowest process's time for them: median (min-max) of the runs",
    "ms/step    the slowest process's time / timed steps;  vs 1 proc = samples/s / one process's;",
    "pt/torch   paratrain's samples/s / torch.distributed.pipelining's on the same schedule (> 1: paratrain faster)",
    "idle       per stage, 1 - compute spans / the step's wall time (paratrain trace=), median over timed steps;",
    "           theory (K-1)/(M+K-1) assumes equal stages and free communication",
    "compute    per stage, forward + backward + optimizer spans per step (ms); imbalance = slowest / mean",
    "RSS +      per stage, peak RSS (VmHWM, reset after warm-up) minus RSS then: what the timed steps added",
    "held       Pipe.peak_held_bytes: inputs + tensors saved for backward of the micro-batches in flight;",
    "           one process: the same count for one micro-batch of the whole model (its loop holds one at a time)",
]


def _kib(nbytes: Any) -> str:
    return "-" if nbytes is None else f"{nbytes / 1024:,.0f} KiB"


def _result(report: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    found: dict[str, Any] | None = report["results"].get(name)
    return found


def _rate(row: Mapping[str, Any] | None) -> float | None:
    return None if row is None else float(row["samples_per_s"])


def render(report: Mapping[str, Any]) -> str:
    """The throughput, bubble, memory and target tables, with the column definitions and what failed."""
    m, b = report["microbatches"], report["batch_size"]
    machine = report["machine"]
    lines = [
        f"pipeline training, batch {b} = {m} micro-batches of {b // m}, {report['steps']} timed steps after "
        f"{report['warmup']} warm-up, {report['repeat']} interleaved run(s); every process single-threaded",
        f"{tables.cpus(machine)}; {tables.load(machine)}",
    ]
    for model in report["models"]:
        lines += ["", *_throughput(report, model)]
    lines += ["", *_bubble(report), "", *_memory(report), "", *_targets(report)]
    lines += tables.footer(
        {**report, "results": report["results"] or {}}, DEFINITIONS, busy=machine.get("others_busy_during"),
        when="during the run",
    )  # fmt: skip
    return "\n".join(lines)


def _throughput(report: Mapping[str, Any], model: str) -> list[str]:
    single = _rate(_result(report, label("single", model)))
    lines = [
        f"{model}: {'engine':<28} {'K':>2} {'samples/s':>10} {'(min-max)':>17} {'ms/step':>8} {'vs 1 proc':>9} "
        f"{'pt/torch':>8}"
    ]
    pad = " " * (len(model) + 2)
    rows: list[tuple[str, int, str]] = [("single", 1, "")]
    for case in (c for c in report["cases"] if c["model"] == model):
        rows += [(e, case["stages"], s) for s in report["schedules"] for e in ("paratrain", "torch")]
    for engine, k, schedule in rows:
        name = label(engine, model, schedule, k)
        row = _result(report, name)
        if engine == "torch" and name not in report["engines"]:
            continue
        text = f"{_ENGINE_NAMES[engine]} {schedule}".strip() if engine != "single" else "one process, 1 thread"
        if row is None:
            status = report["engines"].get(name, {}).get("status", "not run")
            lines.append(f"{pad}{text:<28} {k:>2} {status:>10}")
            continue
        rate = float(row["samples_per_s"])
        spread = f"({min(row['samples_per_s_runs']):,.0f}-{max(row['samples_per_s_runs']):,.0f})"
        vs = f"{rate / single:8.2f}x" if single else f"{'-':>9}"
        other = _rate(_result(report, label("torch", model, schedule, k))) if engine == "paratrain" else None
        pt = f"{rate / other:7.2f}x" if other else ""
        lines.append(f"{pad}{text:<28} {k:>2} {rate:10,.0f} {spread:>17} {row['step_ms']:8.1f} {vs} {pt:>8}")
    return lines


def _bubble(report: Mapping[str, Any]) -> list[str]:
    lines = [
        f"{'bubble: paratrain':<26} {'K':>2} {'M':>2} {'stage':>5} {'idle':>6} {'theory':>6} {'compute ms':>10} "
        f"{'measured imbalance':>18} {'predicted':>9}  balance"
    ]
    for case in report["cases"]:
        k = case["stages"]
        for schedule in report["schedules"]:
            row = _result(report, label("paratrain", case["model"], schedule, k))
            if row is None:
                continue
            measured = imbalance([s["compute_ms"] for s in row["stages"]])
            for s in row["stages"]:
                first = s["stage"] == 0
                lines.append(
                    f"{(case['model'] + ' ' + schedule) if first else '':<26} {k:>2} {report['microbatches']:>2} "
                    f"{s['stage']:>5} {s['idle']:6.1%} {theory_bubble(k, report['microbatches']):6.1%} "
                    f"{s['compute_ms']:10.2f} "
                    + (f"{measured:18.2f} {case['predicted_imbalance']:9.2f}  {case['balance']}" if first else "")
                )
    return lines


def _memory(report: Mapping[str, Any]) -> list[str]:
    lines = [f"{'memory':<40} {'stage':>5} {'RSS +':>11} {'held':>11} {'held, checkpoint':>16} {'micro-batches':>13}"]
    for model in report["models"]:
        single = _result(report, label("single", model))
        if single is not None:
            s = single["stages"][0]
            lines.append(
                f"{model + ' one process':<40} {'-':>5} {_kib(s['rss_growth_bytes']):>11} {_kib(s['held_bytes']):>11}"
            )
        for case in (c for c in report["cases"] if c["model"] == model):
            for engine in ("paratrain", "torch"):
                for schedule in report["schedules"]:
                    row = _result(report, label(engine, model, schedule, case["stages"]))
                    if row is None:
                        continue
                    per_mb = _per_microbatch(report, case)
                    for s in row["stages"]:
                        held = s.get("held_bytes")
                        count = f"{held / per_mb[s['stage']]:13.1f}" if held is not None and per_mb else ""
                        text = (
                            f"{model} {_ENGINE_NAMES[engine]} {schedule} K={case['stages']}" if not s["stage"] else ""
                        )
                        lines.append(
                            f"{text:<40} {s['stage']:>5} {_kib(s['rss_growth_bytes']):>11} {_kib(held):>11} "
                            f"{_kib(s.get('held_bytes_checkpoint')):>16} {count}"
                        )
    return lines


def _per_microbatch(report: Mapping[str, Any], case: Mapping[str, Any]) -> list[float] | None:
    """Per stage, the bytes one micro-batch holds: GPipe's peak / M (GPipe holds all M at once)."""
    row = _result(report, label("paratrain", case["model"], "gpipe", case["stages"]))
    if row is None:
        return None
    return [s["held_bytes"] / report["microbatches"] for s in row["stages"]]


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _targets(report: Mapping[str, Any]) -> list[str]:
    lines = ["targets (issue 12):"]
    m = report["microbatches"]
    for case in report["cases"]:
        model, k = case["model"], case["stages"]
        single = _rate(_result(report, label("single", model)))
        for schedule in report["schedules"]:
            pt = _result(report, label("paratrain", model, schedule, k))
            if pt is None:
                continue
            rate, other = float(pt["samples_per_s"]), _rate(_result(report, label("torch", model, schedule, k)))
            where = f"{model} {schedule} K={k}"
            if other:
                lines.append(f"  {where}: paratrain / torch {rate / other:.2f}x >= {TARGET_VS_TORCH}x: "
                             f"{_met(rate / other >= TARGET_VS_TORCH)}")  # fmt: skip
            if k == 2 and single:
                lines.append(f"  {where}: vs one process {rate / single:.2f}x >= {TARGET_VS_SINGLE}x: "
                             f"{_met(rate / single >= TARGET_VS_SINGLE)}")  # fmt: skip
            theory = theory_bubble(k, m)
            worst = max(abs(s["idle"] - theory) for s in pt["stages"])
            lines.append(
                f"  {where}: bubble, worst stage {worst:.1%} from theory {theory:.1%} "
                f"(within {TARGET_BUBBLE:.0%} of it: {_met(worst <= TARGET_BUBBLE * theory)}; "
                f"within {TARGET_BUBBLE:.0%} points: "
                f"{_met(worst <= TARGET_BUBBLE)})"
            )
            per_mb = _per_microbatch(report, case)
            if per_mb:
                held = [s["held_bytes"] / per_mb[s["stage"]] for s in pt["stages"]]
                bound = [min(k - s, m) if schedule == "1f1b" else m for s in range(k)]
                inputs = [s["held_bytes_checkpoint"] / case["input_bytes"][s["stage"]] for s in pt["stages"]]
                ok = all(h <= b + 1e-6 for h, b in zip(held, bound, strict=True))
                lines.append(
                    f"  {where}: micro-batches held per stage {', '.join(f'{h:.1f}' for h in held)} <= "
                    f"{bound}: {_met(ok)}; with checkpoint, stage inputs held {', '.join(f'{i:.1f}' for i in inputs)}"
                )
        predicted = case["predicted_imbalance"]
        lines.append(f"  {model} K={k}: partitioner's slowest / mean predicted {predicted:.2f} <= {TARGET_IMBALANCE}: "
                     f"{_met(predicted <= TARGET_IMBALANCE)}")  # fmt: skip
        for schedule in report["schedules"]:
            pt = _result(report, label("paratrain", model, schedule, k))
            if pt is not None:
                measured = imbalance([s["compute_ms"] for s in pt["stages"]])
                lines.append(f"  {model} K={k} {schedule}: measured compute slowest / mean {measured:.2f} <= "
                             f"{TARGET_IMBALANCE}: {_met(measured <= TARGET_IMBALANCE)}")  # fmt: skip
    return lines
