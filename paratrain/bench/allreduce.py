"""``paratrain bench allreduce``: paratrain's allreduce against Gloo and OpenMPI, same sizes, same machine, one run.

Engines, run one after the other so they never compete for cores:

* ``paratrain[ALGO]``: the public ``pt.allreduce_(x, algorithm=ALGO)`` in N ranks under ``paratrain launch``;
* ``paratrain-shm``: the shared-memory path (:class:`~paratrain.collectives.shm.ShmGroup`) directly, in the same
  processes: the fast path without the API's per-call agreement;
* ``gloo``: ``torch.distributed.all_reduce`` with the Gloo backend, N processes started here;
* ``mpi``: ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` through mpi4py under ``mpirun``.

Every engine reduces float32 buffers with sum and runs the same loop (:mod:`paratrain.bench._timing`): a
verified allreduce, warm-up, a barrier, then ``iters`` calls back to back. Definitions (nccl-tests):

* ``time_us``: the mean time per call of the back-to-back loop, the slowest rank's (nccl-tests' average); with
  ``--repeat R`` every engine runs R times, interleaved with the others, and the median run counts (all runs are
  kept in ``runs_us``);
* ``p50_us``: the median over calls of the slowest rank's time for that call;
* ``algbw_gbps`` = bytes / time; ``busbw_gbps`` = algbw x 2(N-1)/N, the traffic each rank's link carries in a
  bandwidth-optimal allreduce, comparable across N;
* ``ratios``: for paratrain rows, an anchor's time / this row's time (> 1: paratrain is faster).

Every child process runs under a deadline (``--timeout``); a failing or hung engine is reported, and the others
still run. Engines whose software is missing (torch, mpi4py, mpirun) are skipped with a note.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from paratrain.bench._timing import cpu_model, format_bytes
from paratrain.launch.groups import die_with_parent

__all__ = [
    "ALGORITHMS",
    "ANCHORS",
    "DEFAULT_SIZES",
    "BenchOptions",
    "combine_runs",
    "cpu_busy",
    "default_iters",
    "gloo_unavailable",
    "mpi_unavailable",
    "parse_size",
    "parse_sizes",
    "render_table",
    "run_bench",
    "summarize",
]

#: The sizes measured when ``--sizes`` is not given.
DEFAULT_SIZES = "4KiB,1MiB,16MiB,64MiB"
#: The reference implementations ``--compare`` may name.
ANCHORS = ("gloo", "mpi")
#: What ``--algorithm`` accepts (``shm`` is registered into the API if it does not know it yet).
ALGORITHMS = ("auto", "ring", "tree", "shm")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")
_MAX_BYTES = 4 << 30
_GRACE_S = 3.0


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``1024``, ``4KiB``/``4K`` (x1024), ``16MB`` (x1000); case-insensitive.

    The size must be a positive multiple of 4 (float32 elements) of at most 4 GiB.

    Raises:
        ValueError: with a message saying what is accepted.

    Example:
        >>> parse_size("4KiB"), parse_size("16MB"), parse_size("1024")
        (4096, 16000000, 1024)
    """
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"bad size {text!r}: use a whole number with an optional unit, e.g. 1024, 4KiB, 4K, 1MiB, 16MB "
            "(K/KiB/M/MiB/G/GiB are powers of 1024; KB/MB/GB powers of 1000)"
        )
    nbytes = int(match.group(1)) * _UNITS[unit or ""]
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"bad size {text!r}: must be a positive multiple of 4 bytes (float32 elements)")
    if nbytes > _MAX_BYTES:
        raise ValueError(f"bad size {text!r}: at most 4 GiB per buffer")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of :func:`parse_size` sizes, in the order given, duplicates removed.

    Example:
        >>> parse_sizes("4KiB, 1MiB")
        [4096, 1048576]
    """
    sizes: list[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        nbytes = parse_size(part)
        if nbytes not in sizes:
            sizes.append(nbytes)
    if not sizes:
        raise ValueError("no sizes given; e.g. --sizes 4KiB,1MiB,16MiB")
    return sizes


def default_iters(nbytes: int) -> int:
    """Timed calls per size when ``--iters`` is not given: enough for a stable mean, ~1 s for the slowest engine."""
    if nbytes <= 64 << 10:
        return 500
    if nbytes <= 1 << 20:
        return 100
    if nbytes <= 16 << 20:
        return 30
    return 10


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions:
    """What to measure.

    Attributes:
        nproc: ranks (processes) per engine, all on this host.
        sizes: message sizes in bytes.
        compare: anchors to run (subset of :data:`ANCHORS`).
        iters: timed calls per size (None: :func:`default_iters`).
        warmup: untimed calls per size.
        algorithm: ``algorithm=`` of ``pt.allreduce_``.
        timeout: seconds each engine may run before its processes are stopped.
        shm: also time the shared-memory path directly (``paratrain-shm``).
        repeat: run every engine this many times, interleaved, and report the median run.
    """

    nproc: int
    sizes: tuple[int, ...]
    compare: tuple[str, ...] = ANCHORS
    iters: int | None = None
    warmup: int = 5
    algorithm: str = "auto"
    timeout: float = 600.0
    shm: bool = True
    repeat: int = 1

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"--np must be at least 1, got {self.nproc}")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"--iters must be at least 1, got {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        unknown = [a for a in self.compare if a not in ANCHORS]
        if unknown:
            raise ValueError(f"--compare takes {', '.join(ANCHORS)} (or none), got {', '.join(unknown)}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {self.repeat}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")

    def iters_for(self, nbytes: int) -> int:
        """Timed calls for a size."""
        return self.iters if self.iters is not None else default_iters(nbytes)


@dataclass(slots=True)
class _EngineRun:
    status: str  # "ok", "skipped" or "error"
    detail: str
    payloads: list[dict[str, Any]]


# -- running the engines ------------------------------------------------------------------------------------------


def _worker_args(options: BenchOptions, out_dir: str) -> list[str]:
    return [
        "--sizes",
        ",".join(str(s) for s in options.sizes),
        "--iters",
        ",".join(str(options.iters_for(s)) for s in options.sizes),
        "--warmup",
        str(options.warmup),
        "--out",
        out_dir,
        "--deadline",
        str(max(options.timeout - _GRACE_S, 1.0)),
    ]


def _collect(out_dir: str, engine: str, nproc: int) -> _EngineRun:
    payloads = []
    for rank in range(nproc):
        path = os.path.join(out_dir, f"{engine}-rank{rank}.json")
        try:
            with open(path, encoding="utf-8") as fh:
                payloads.append(json.load(fh))
        except (OSError, ValueError):
            return _EngineRun(
                "error", f"rank {rank} wrote no result (it failed or timed out; see the output above)", []
            )
    errors = [f"rank {p['rank']}: {p.get('error', '?')}" for p in payloads if p.get("status") != "ok"]
    if errors:
        return _EngineRun("error", "; ".join(errors), [])
    return _EngineRun("ok", "", payloads)


def _run_paratrain(options: BenchOptions, out_dir: str) -> dict[str, _EngineRun]:
    from paratrain.errors import ConfigError
    from paratrain.launch.run import run_launch

    engines = ["paratrain", *(["paratrain-shm"] if options.shm else [])]
    cmd = [
        "python",
        "-m",
        "paratrain.bench._allreduce_worker",
        *_worker_args(options, out_dir),
        "--algorithm",
        options.algorithm,
        "--engines",
        ",".join(engines),
    ]
    try:
        code = run_launch(cmd, nproc=options.nproc, prefix=False, timeout=options.timeout, grace=_GRACE_S)
    except (ConfigError, OSError) as exc:
        return {engine: _EngineRun("error", f"paratrain launch failed to start: {exc}", []) for engine in engines}
    runs = {engine: _collect(out_dir, engine, options.nproc) for engine in engines}
    if code != 0:
        for run in runs.values():
            if run.status == "ok":
                continue
            run.detail = f"paratrain launch exited {code}: {run.detail}"
    return runs


def _stop_group(pgid: int) -> None:
    for sig, wait in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def _run_processes(commands: Sequence[tuple[list[str], dict[str, str]]], timeout: float) -> str | None:
    """Runs the commands together (each in its own session); None if all exit 0, else what went wrong.

    On the first failure or at the deadline every process group still alive is stopped (SIGTERM, then SIGKILL),
    so nothing is left running.
    """
    procs: list[subprocess.Popen[bytes]] = []
    problem: str | None = None
    try:
        for argv, env in commands:
            # die_with_parent makes two system calls in the child; prctl is resolved before the fork
            setup = die_with_parent()
            procs.append(
                subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL, preexec_fn=setup)  # noqa: PLW1509
            )
        deadline = time.monotonic() + timeout
        while problem is None:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                problem = f"process {failed[0][0]} exited with code {failed[0][1]}"
            elif all(c == 0 for c in codes):
                return None
            elif time.monotonic() >= deadline:
                problem = f"still running after {timeout:.0f}s (--timeout); stopped"
            else:
                time.sleep(0.05)
    except OSError as exc:
        problem = f"could not start {commands[len(procs)][0][0]}: {exc}"
    finally:
        for p in procs:
            if p.poll() is None:
                _stop_group(p.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5.0)
            _stop_group(p.pid)  # helpers the process may have left in its session
    return problem


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env(options: BenchOptions) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nproc)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


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


def _run_gloo(options: BenchOptions, out_dir: str) -> _EngineRun:
    why = gloo_unavailable()
    if why is not None:
        return _EngineRun("skipped", why, [])
    base = _child_env(options)
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(options.nproc)})
    if sys.platform.startswith("linux"):
        base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    argv = [sys.executable, "-m", "paratrain.bench._gloo_worker", *_worker_args(options, out_dir)]
    commands = [(argv, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(options.nproc)]
    problem = _run_processes(commands, options.timeout)
    run = _collect(out_dir, "gloo", options.nproc)
    if problem is not None and run.status == "ok":
        return _EngineRun("error", problem, [])
    if problem is not None:
        run.detail = f"{problem}: {run.detail}"
    return run


def _run_mpi(options: BenchOptions, out_dir: str) -> _EngineRun:
    why = mpi_unavailable()
    if why is not None:
        return _EngineRun("skipped", why, [])
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
        *_worker_args(options, out_dir),
    ]
    problem = _run_processes([(argv, env)], options.timeout)
    run = _collect(out_dir, "mpi", options.nproc)
    if problem is not None and run.status == "ok":
        return _EngineRun("error", problem, [])
    if problem is not None:
        run.detail = f"{problem}: {run.detail}"
    return run


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
        records = [p["results"][index] for p in payloads]
        nbytes, iters = int(first["bytes"]), int(first["iters"])
        mean_s = max(r["total_s"] / max(r["iters"], 1) for r in records)
        slowest = [max(r["times_s"][i] for r in records) for i in range(min(len(r["times_s"]) for r in records))]
        p50_s = statistics.median(slowest) if slowest else mean_s
        algbw = nbytes / mean_s / 1e9 if mean_s > 0 else 0.0
        rows.append(
            {
                "engine": engine,
                "bytes": nbytes,
                "size": format_bytes(nbytes),
                "iters": iters,
                "time_us": round(mean_s * 1e6, 3),
                "p50_us": round(p50_s * 1e6, 3),
                "algbw_gbps": round(algbw, 4),
                "busbw_gbps": round(algbw * 2 * (nproc - 1) / nproc, 4) if nproc > 1 else 0.0,
            }
        )
    return rows


def _add_ratios(rows: list[dict[str, Any]], anchors: Sequence[str]) -> None:
    times = {(r["engine"], r["bytes"]): r["time_us"] for r in rows}
    for row in rows:
        if row["engine"].startswith("paratrain"):
            row["ratios"] = {
                a: round(times[(a, row["bytes"])] / row["time_us"], 3)
                for a in anchors
                if (a, row["bytes"]) in times and row["time_us"] > 0
            }


def render_table(report: dict[str, Any]) -> str:
    """The report as a text table for people, with the definitions and skipped engines underneath."""
    anchors = [a for a in report["compare"] if report["engines"].get(a, {}).get("status") == "ok"]
    machine = report["machine"]
    busy = machine.get("busy_before")
    lines = [
        f"allreduce (float32, sum), {report['np']} ranks on one host; {machine['cpus']} CPUs ({machine['processor']}); "
        + (f"CPUs {busy:.0%} busy before the run" if busy is not None else "")
        + f"; load average {machine['load_before'][0]:.2f} before, {machine['load_after'][0]:.2f} after",
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
    if not report["results"]:
        lines.append(f"{'':>9}  (no engine produced results; see the errors below)")
    lines += [
        "",
        "time: mean per call over back-to-back calls, slowest rank (nccl-tests style)"
        + (f", median of {report['repeat']} interleaved runs;" if report["repeat"] > 1 else ";"),
        "p50: median over calls of the slowest rank's time; algbw = bytes/time; busbw = algbw*2(N-1)/N;",
        "X/this = X's time / this row's time (> 1 means paratrain is faster).",
    ]
    for name, info in report["engines"].items():
        if info["status"] != "ok":
            lines.append(f"{name}: {info['status']}: {info['detail']}")
    busy = machine.get("busy_before")
    if busy is not None and busy > 0.2:
        lines.append(
            f"note: other processes kept the CPUs {busy:.0%} busy just before the run; timings are noisy — "
            "re-run on an idle machine."
        )
    return "\n".join(lines)


def cpu_busy(seconds: float) -> float | None:
    """The fraction of CPU time (all CPUs, steal included) that others used over ``seconds``; None off Linux.

    Why not the load average: it is a 1-minute average, so it still counts a benchmark run that just ended,
    while this sample shows what else is running right now.
    """

    def sample() -> list[int] | None:
        try:
            with open("/proc/stat", encoding="utf-8") as fh:
                return [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None

    first = sample()
    time.sleep(seconds)
    second = sample()
    if first is None or second is None:
        return None
    delta = [b - a for a, b in zip(first, second, strict=False)]
    total = sum(delta[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    idle = delta[3] + delta[4]
    return round(1 - idle / total, 3) if total > 0 else None


def _labels(name: str, options: BenchOptions) -> list[str]:
    if name != "paratrain":
        return [name]
    return [f"paratrain[{options.algorithm}]", *(["paratrain-shm"] if options.shm else [])]


def combine_runs(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of repeated runs of one engine merged: the median of each time, every run's time kept in ``runs_us``.

    Why the median of runs: on a shared or virtual machine a whole run can land in a slow period (a neighbour's
    load, a migrated vCPU); interleaving the engines' runs and taking the median keeps one bad period from
    deciding a comparison, without hiding the spread (``runs_us``).

    Example:
        >>> rows = [[{"bytes": 8, "time_us": t, "p50_us": t, "algbw_gbps": 0, "busbw_gbps": 0}] for t in (3, 1, 2)]
        >>> merged = combine_runs(rows)[0]
        >>> merged["time_us"], merged["runs_us"]
        (2, [3, 1, 2])
    """
    merged = []
    for index, first in enumerate(runs[0]):
        same = [run[index] for run in runs]
        row = dict(first)
        row["time_us"] = statistics.median(r["time_us"] for r in same)
        row["p50_us"] = statistics.median(r["p50_us"] for r in same)
        row["runs_us"] = [r["time_us"] for r in same]
        if row["time_us"] > 0 and first["time_us"] > 0:
            scale = first["time_us"] / row["time_us"]
            row["algbw_gbps"] = round(first["algbw_gbps"] * scale, 4)
            row["busbw_gbps"] = round(first["busbw_gbps"] * scale, 4)
        merged.append(row)
    return merged


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

    load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else [0.0, 0.0, 0.0]
    busy_before = cpu_busy(0.5)
    engines: dict[str, dict[str, str]] = {}
    per_engine: dict[str, list[list[dict[str, Any]]]] = {}  # label -> one list of rows per repetition
    plan = ["paratrain", *options.compare]
    sizes = ", ".join(format_bytes(s) for s in options.sizes)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as root:
        for rep in range(options.repeat):
            out_dir = os.path.join(root, f"run{rep}")
            os.mkdir(out_dir)
            prefix = f"[run {rep + 1}/{options.repeat}] " if options.repeat > 1 else ""
            for step, name in enumerate(plan, 1):
                head = f"{prefix}[{step}/{len(plan)}]"
                if any(engines.get(label, {}).get("status") == "error" for label in _labels(name, options)):
                    continue  # failed in an earlier run: do not try again
                if name == "paratrain":
                    what = f"pt.allreduce_(algorithm={options.algorithm!r})" + (
                        " and the shm path" if options.shm else ""
                    )
                    say(f"{head} paratrain: {what}, {options.nproc} ranks, sizes {sizes}")
                    runs = _run_paratrain(options, out_dir)
                elif name == "gloo":
                    say(f"{head} gloo: torch.distributed all_reduce, {options.nproc} processes")
                    runs = {"gloo": _run_gloo(options, out_dir)}
                else:
                    say(f"{head} mpi: mpirun -np {options.nproc}, comm.Allreduce")
                    runs = {"mpi": _run_mpi(options, out_dir)}
                for engine, run in runs.items():
                    label = f"paratrain[{options.algorithm}]" if engine == "paratrain" else engine
                    engines[label] = {"status": run.status, "detail": run.detail}
                    if run.status == "ok":
                        per_engine.setdefault(label, []).append(summarize(label, run.payloads, options.nproc))
                    else:
                        say(f"    {label}: {run.status}: {run.detail}")
    rows = [row for reps in per_engine.values() for row in combine_runs(reps)]
    _add_ratios(rows, [a for a in options.compare if engines.get(a, {}).get("status") == "ok"])
    report: dict[str, Any] = {
        "benchmark": "allreduce",
        "np": options.nproc,
        "dtype": "float32",
        "op": "sum",
        "algorithm": options.algorithm,
        "sizes": list(options.sizes),
        "compare": list(options.compare),
        "repeat": options.repeat,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count() or 1,
            "platform": platform.platform(),
            "processor": cpu_model(),
            "python": platform.python_version(),
            "load_before": load_before,
            "busy_before": busy_before,
            "load_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else [0.0, 0.0, 0.0],
        },
        "timing": (
            "time_us: mean per call of `iters` back-to-back calls, slowest rank (nccl-tests average), median "
            "over `repeat` interleaved runs (all in runs_us); "
            "p50_us: median over calls of the slowest rank's time; algbw_gbps = bytes/time/1e9; "
            "busbw_gbps = algbw*2(N-1)/N; ratios[anchor] = anchor time / this time (>1: paratrain faster)"
        ),
        "engines": engines,
        "results": rows,
    }
    code = 1 if any(info["status"] == "error" for info in engines.values()) else 0
    return report, code
