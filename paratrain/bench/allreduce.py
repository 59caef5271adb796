"""``paratrain bench allreduce``: paratrain's allreduce against Gloo and OpenMPI, same sizes, same machine, one run.

Engines, run one after the other so they never compete for cores:

* ``paratrain[ALGO]``: the public ``pt.allreduce_(x, algorithm=ALGO)`` in N ranks under ``paratrain launch``
  (``gloo``: torch tensors through paratrain's torch.distributed engine, :mod:`paratrain.collectives.torch_engines`, so
  that the ratio to the ``gloo`` anchor is what paratrain's agreement and bookkeeping cost on top of Gloo);
* ``paratrain-shm``: the shared-memory path (:class:`~paratrain.collectives.shm.ShmGroup`) directly, in the same
  processes: the fast path without the API's per-call agreement;
* ``gloo``: ``torch.distributed.all_reduce`` with the Gloo backend, N processes started here;
* ``mpi``: ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` through mpi4py under ``mpirun``;
* ``horovod``: ``hvd.allreduce_(t, op=hvd.Sum)`` under ``horovodrun --gloo`` (Horovod's CPU path: its background
  loop negotiates, fuses and reduces with Gloo), where Horovod is installed (``benchmarks/horovod/build.sh``).

Every engine reduces float32 buffers with sum and runs the same loop (:mod:`paratrain.bench._timing`): a
verified allreduce, warm-up, a barrier, then ``iters`` calls back to back. Definitions (nccl-tests):

* ``time_us``: the mean time per call of the back-to-back loop, the slowest rank's (nccl-tests' average); with
  ``--repeat R`` every engine runs R times, interleaved with the others, and the median run counts (all runs are
  kept in ``runs_us``);
* ``p50_us``: the median over calls of the slowest rank's time for that call;
* ``algbw_gbps`` = bytes / time; ``busbw_gbps`` = algbw x 2(N-1)/N, the traffic each rank's link carries in a
  bandwidth-optimal allreduce, comparable across N;
* ``ratios``: for paratrain rows, an anchor's time / this row's time (> 1: paratrain is faster).

Every engine's job runs under a deadline (``--timeout``); a failing or hung engine is reported, and the others
still run. Engines whose software is missing (torch, mpi4py, mpirun) are skipped with a note. What every
``paratrain bench`` shares (running jobs, rounds, medians, the machine block) is in :mod:`.harness`,
:mod:`.stats`, :mod:`.machine` and :mod:`.tables`; this module holds the engines and the columns.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TextIO

from paratrain.bench import harness, stats, tables
from paratrain.bench._operations import OPERATIONS
from paratrain.bench._timing import format_bytes
from paratrain.bench.harness import EngineRun, SizedOptions, Step
from paratrain.bench.machine import MachineSample, machine_report
from paratrain.errors import ConfigError
from paratrain.launch.env import process_environment
from paratrain.launch.plan import free_port

__all__ = [
    "ALGORITHMS",
    "ANCHORS",
    "DEFAULT_SIZES",
    "BenchOptions",
    "combine_runs",
    "gloo_unavailable",
    "horovod_unavailable",
    "mpi_unavailable",
    "render_table",
    "run_bench",
    "summarize",
]

#: The sizes measured when ``--sizes`` is not given.
DEFAULT_SIZES = "4KiB,1MiB,16MiB,64MiB"
#: The reference implementations ``--compare`` may name.
ANCHORS = ("gloo", "mpi", "horovod")
#: What ``--algorithm`` accepts (``shm`` is registered into the API if it does not know it yet).
ALGORITHMS = ("auto", "ring", "tree", "direct", "halving_doubling", "torus", "double_tree", "shm", "gloo")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions(SizedOptions):
    """What to measure (and, from :class:`~paratrain.bench.harness.SizedOptions`: sizes, iters, warmup, repeat,
    timeout).

    Attributes:
        nproc: ranks (processes) per engine, all on this host.
        compare: anchors to run (subset of :data:`ANCHORS`).
        algorithm: ``algorithm=`` of ``pt.allreduce_``.
        shm: also time the shared-memory path directly (``paratrain-shm``; allreduce only).
        op: the collective (:data:`~paratrain.bench._operations.OPERATIONS`; besides allreduce, paratrain's
            public call against MPI's, sizes per rank's block).
    """

    #: Small messages are latency-bound and cheap: 500 calls give a stable mean (then 100, 30, 10 as sizes grow).
    SMALL_ITERS: ClassVar[int] = 500

    nproc: int
    compare: tuple[str, ...] = ANCHORS
    warmup: int = 5
    algorithm: str = "auto"
    timeout: float = 600.0
    shm: bool = True
    op: str = "allreduce"

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--np must be at least 1, got {self.nproc}")  # --np, as mpirun names it
        SizedOptions.__post_init__(self)
        if self.op not in OPERATIONS:
            raise ConfigError(f"--op must be one of {', '.join(OPERATIONS)}, got {self.op!r}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        unknown = [a for a in self.compare if a not in ANCHORS]
        if unknown:
            raise ConfigError(f"--compare takes {', '.join(ANCHORS)} (or none), got {', '.join(unknown)}")


# -- the engines ---------------------------------------------------------------------------------------------------


def _shm(options: BenchOptions) -> bool:
    return options.shm and options.op == "allreduce"


def _paratrain_labels(options: BenchOptions) -> tuple[str, ...]:
    main = f"paratrain[{options.algorithm}]" if options.op == "allreduce" else f"paratrain {options.op}"
    return (main, *(["paratrain-shm"] if _shm(options) else []))


def _run_paratrain(options: BenchOptions, out_dir: str) -> dict[str, EngineRun]:
    engines = ["paratrain", *(["paratrain-shm"] if _shm(options) else [])]
    cmd = [
        "python",
        "-m",
        "paratrain.bench._allreduce_worker",
        *harness.worker_args(options, out_dir),
        "--algorithm",
        options.algorithm,
        "--engines",
        ",".join(engines),
        "--op",
        options.op,
    ]
    problem = harness.launch_job(cmd, nproc=options.nproc, timeout=options.timeout, deadline_s=options.deadline_s())
    runs = {
        label: harness.collect(out_dir, engine, options.nproc)
        for label, engine in zip(_paratrain_labels(options), engines, strict=True)
    }
    return harness.judge(runs, problem)


def _child_env(options: BenchOptions) -> dict[str, str]:
    return process_environment(os.environ, processes=options.nproc)


def gloo_unavailable() -> str | None:
    """Why the Gloo anchor cannot run here, or None."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch) — Gloo column skipped"
    return None


def mpi_unavailable() -> str | None:
    """Why the MPI anchor cannot run here, or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py) — skipped"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (apt-get install openmpi-bin) — MPI column skipped"
    return None


def horovod_unavailable() -> str | None:
    """None when Horovod's PyTorch API and ``horovodrun`` are installed, else why the column is skipped."""
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed (bash benchmarks/horovod/build.sh builds it against this torch) — skipped"
    if _horovodrun() is None:
        return "horovodrun is not on PATH — Horovod column skipped"
    return None


def _horovodrun() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return shutil.which("horovodrun") or (beside if os.path.exists(beside) else None)


def _run_horovod(options: BenchOptions, out_dir: str) -> dict[str, EngineRun]:
    why = horovod_unavailable()
    if why is not None:
        return {"horovod": EngineRun("skipped", why)}
    n = options.nproc
    runner = _horovodrun() or "horovodrun"
    argv = [runner, "-np", str(n), "-H", f"localhost:{n}", "--gloo", sys.executable, "-m"]
    argv += ["paratrain.bench._horovod_worker", *harness.worker_args(options, out_dir)]
    return _run_anchor("horovod", [(argv, _child_env(options) | {"HOROVOD_CPU_OPERATIONS": "gloo"})], options, out_dir)


def _run_anchor(
    engine: str, commands: Sequence[tuple[list[str], dict[str, str]]], options: BenchOptions, out_dir: str
) -> dict[str, EngineRun]:
    problem = harness.run_job(commands, timeout=options.timeout, deadline_s=options.deadline_s())
    return harness.judge({engine: harness.collect(out_dir, engine, options.nproc)}, problem)


def _run_gloo(options: BenchOptions, out_dir: str) -> dict[str, EngineRun]:
    why = gloo_unavailable()
    if why is not None:
        return {"gloo": EngineRun("skipped", why)}
    base = _child_env(options)
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(options.nproc)})
    if sys.platform.startswith("linux"):
        base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    argv = [sys.executable, "-m", "paratrain.bench._gloo_worker", *harness.worker_args(options, out_dir)]
    commands = [(argv, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(options.nproc)]
    return _run_anchor("gloo", commands, options, out_dir)


def _run_mpi(options: BenchOptions, out_dir: str) -> dict[str, EngineRun]:
    why = mpi_unavailable()
    if why is not None:
        return {"mpi": EngineRun("skipped", why)}
    env = _child_env(options)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    mpirun = shutil.which("mpirun") or "mpirun"
    argv = [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(options.nproc),
        sys.executable,
        "-m",
        "paratrain.bench._mpi_worker",
        *harness.worker_args(options, out_dir),
        "--op",
        options.op,
    ]
    return _run_anchor("mpi", [(argv, env)], options, out_dir)


def _steps(options: BenchOptions) -> list[Step]:
    sizes = ", ".join(format_bytes(s) for s in options.sizes)
    what = f"pt.allreduce_(algorithm={options.algorithm!r})" + (" and the shm path" if _shm(options) else "")
    if options.op != "allreduce":
        what = f"pt.{options.op} (root 0)" if options.op != "alltoall" else "pt.alltoall"
    steps = [
        Step(
            _paratrain_labels(options),
            f"paratrain: {what}, {options.nproc} ranks, sizes {sizes}",
            functools.partial(_run_paratrain, options),
        )
    ]
    anchors = {
        "gloo": (f"gloo: torch.distributed all_reduce, {options.nproc} processes", _run_gloo),
        "mpi": (f"mpi: mpirun -np {options.nproc}, comm.{options.op.capitalize()}", _run_mpi),
        "horovod": (f"horovod: horovodrun -np {options.nproc} --gloo, hvd.allreduce_", _run_horovod),
    }
    for name in options.compare:  # in the order the user gave
        if options.op != "allreduce" and name != "mpi":
            continue  # (Gloo's and Horovod's columns time allreduce)
        describe, run = anchors[name]
        steps.append(Step((name,), describe, functools.partial(run, options)))
    return steps


# -- numbers and the table ---------------------------------------------------------------------------------------


def summarize(engine: str, payloads: Sequence[dict[str, Any]], nproc: int) -> list[dict[str, Any]]:
    """One result row per size from the per-rank records of one engine (see the module notes for definitions).

    Example:
        >>> rec = lambda t: {"results": [{"bytes": 4000, "iters": 2, "total_s": t, "times_s": [t / 2, t / 2]}]}
        >>> row = summarize("x", [rec(0.002), rec(0.004)], 2)[0]
        >>> row["time_us"], row["algbw_gbps"], row["busbw_gbps"]
        (2000.0, 0.002, 0.002)
    """
    rows = []
    for index, first in enumerate(payloads[0]["results"]):
        mean_s, slowest = stats.slowest_rank([p["results"][index] for p in payloads])
        p50_s = statistics.median(slowest) if slowest else mean_s
        nbytes = int(first["bytes"])
        algbw = nbytes / mean_s / 1e9 if mean_s > 0 else 0.0
        rows.append(
            {
                "engine": engine,
                "bytes": nbytes,
                "size": format_bytes(nbytes),
                "iters": int(first["iters"]),
                "time_us": round(mean_s * 1e6, 3),
                "p50_us": round(p50_s * 1e6, 3),
                "algbw_gbps": round(algbw, 4),
                "busbw_gbps": round(algbw * 2 * (nproc - 1) / nproc, 4) if nproc > 1 else 0.0,
            }
        )
    return rows


def combine_runs(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of repeated runs of one engine merged: the median of each time, every run's time kept in ``runs_us``.

    See :func:`paratrain.bench.stats.combine_runs` for why the median of interleaved runs.

    Example:
        >>> rows = [[{"bytes": 8, "time_us": t, "p50_us": t, "algbw_gbps": 0, "busbw_gbps": 0}] for t in (3, 1, 2)]
        >>> merged = combine_runs(rows)[0]
        >>> merged["time_us"], merged["runs_us"]
        (2, [3, 1, 2])
    """
    return stats.combine_runs(runs, times=("time_us", "p50_us"), rates=("algbw_gbps", "busbw_gbps"), runs_key="runs_us")


def _add_ratios(rows: list[dict[str, Any]], anchors: Sequence[str]) -> None:
    times: Mapping[tuple[str, int], float] = {(r["engine"], r["bytes"]): r["time_us"] for r in rows}
    for row in rows:
        if row["engine"].startswith("paratrain"):
            ratios = {a: stats.ratio(times.get((a, row["bytes"])), row["time_us"]) for a in anchors}
            row["ratios"] = {a: value for a, value in ratios.items() if value is not None}


def render_table(report: dict[str, Any]) -> str:
    """The report as a text table for people, with the definitions and skipped engines underneath."""
    anchors = [a for a in report["compare"] if report["engines"].get(a, {}).get("status") == "ok"]
    machine = report["machine"]
    busy = machine.get("busy_before")
    lines = [
        f"allreduce (float32, sum), {report['np']} ranks on one host; {tables.cpus(machine)}; "
        + (f"CPUs {busy:.0%} busy before the run" if busy is not None else "")
        + f"; {tables.load(machine)}",
        "",
    ]
    header = (
        f"{'size':>9}  {'engine':<18} {'iters':>6} {'time (us)':>11} {'p50 (us)':>11} {'algbw GB/s':>11} "
        f"{'busbw GB/s':>11}" + "".join(f" {a + '/this':>10}" for a in anchors)
    )
    lines += [header, "-" * len(header)]
    previous = None
    for row in sorted(report["results"], key=lambda r: (r["bytes"], _engine_order(r["engine"]))):
        size = row["size"] if row["bytes"] != previous else ""
        previous = row["bytes"]
        ratios = row.get("ratios", {})
        cells = "".join(f" {ratios[a]:>9.2f}x" if a in ratios else f" {'':>10}" for a in anchors)
        lines.append(
            f"{size:>9}  {row['engine']:<18} {row['iters']:>6} {row['time_us']:>11.1f} {row['p50_us']:>11.1f} "
            f"{row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f}{cells}"
        )
    definitions = [
        "time: mean per call over back-to-back calls, slowest rank (nccl-tests style)"
        + tables.rounds_note(report["repeat"]),
        "p50: median over calls of the slowest rank's time; algbw = bytes/time; busbw = algbw*2(N-1)/N;",
        "X/this = X's time / this row's time (> 1 means paratrain is faster).",
    ]
    lines += tables.footer(report, definitions, busy=busy, when="just before the run")
    return "\n".join(lines)


def _engine_order(engine: str) -> int:
    order = ["paratrain-shm", *ANCHORS]
    return 0 if engine.startswith("paratrain[") else 1 + order.index(engine) if engine in order else 9


# -- the whole run ----------------------------------------------------------------------------------------------


def run_bench(options: BenchOptions, *, out: TextIO | None = None) -> tuple[dict[str, Any], int]:
    """Runs every engine on every size and returns the report (as written by ``--json``) and the exit code.

    The exit code is 1 if an engine failed (a skipped anchor is not a failure), else 0. Blocks for as long as
    the measurements take, at most about ``options.timeout`` per engine.
    """
    stream = out if out is not None else sys.stdout

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    before = MachineSample.take()
    rounds = harness.run_rounds(
        _steps(options),
        repeat=options.repeat,
        summarize=lambda label, payloads: summarize(label, payloads, options.nproc),
        say=say,
    )
    rows = [row for reps in rounds.rows.values() for row in combine_runs(reps)]
    _add_ratios(rows, [a for a in options.compare if rounds.engines.get(a, {}).get("status") == "ok"])
    report: dict[str, Any] = {
        "benchmark": "allreduce",
        "np": options.nproc,
        "dtype": "float32",
        "op": "sum",
        "algorithm": options.algorithm,
        "collective": options.op,
        "sizes": list(options.sizes),
        "compare": list(options.compare),
        "repeat": options.repeat,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_report(before),
        "timing": (
            "time_us: mean per call of `iters` back-to-back calls, slowest rank (nccl-tests average), median "
            "over `repeat` interleaved runs (all in runs_us); "
            "p50_us: median over calls of the slowest rank's time; algbw_gbps = bytes/time/1e9; "
            "busbw_gbps = algbw*2(N-1)/N; ratios[anchor] = anchor time / this time (>1: paratrain faster)"
        ),
        "engines": rounds.engines,
        "results": rows,
    }
    return report, harness.exit_code(rounds.engines)
