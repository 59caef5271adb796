"""``paratrain bench ps``: the parameter server's push/clock/pull against the bytes-only ceiling of its transport.

Two engines run one after the other (never at the same time, so they never share the CPUs), and with
``--repeat R`` R times, interleaved:

* ``ps``: a real job, ``paratrain launch -n W --servers S``. Every worker makes a :class:`~paratrain.ps.KVStore`
  with the chosen consistency, initialises one float32 key of each size (the store cuts it into 1 MiB chunks
  dealt over the servers), checks one round, then times ``iters`` iterations of ``push(key, grad)`` +
  ``clock()`` + ``pull(key)`` (:mod:`._ps_worker`).
* ``ceiling``: the same bytes over the same path without a parameter server: ``paratrain launch -n W+S``, the
  first W ranks send each chunk of the same plan to the rank that would serve it and receive it back; the other
  S ranks echo every chunk as soon as it arrives, zero-copy (:mod:`._ps_ceiling_worker`). Same transport
  (ZeroMQ; ipc inside one host), same number and kind of processes, same chunks.

A third reference, ``memcpy``, is measured in this process before the jobs: ``np.copyto`` of each size. A
parameter server over shared memory would copy each pushed byte into the shared segment once and each pulled
byte out once, so a worker's push+pull throughput could not beat one core's copy bandwidth: it is the
shared-memory ceiling, for comparison only (our PS goes over ZeroMQ, and ``ceiling`` is the ceiling of that).

Definitions (every worker moves ``2 x size`` bytes per iteration: ``size`` pushed and ``size`` pulled):

* ``mean_ms``: the slowest worker's wall time of the back-to-back loop / iterations; with ``--repeat R`` the
  median of the R runs (all kept in ``runs_ms``);
* ``p50_ms``, ``p90_ms``: median and 90th percentile over iterations of the slowest worker's time for it;
* ``worker_gbps`` = 2 x size / mean time: bytes pushed + pulled per second by one worker (10^9 B/s);
* ``aggregate_gbps`` = W x ``worker_gbps``: what all workers move together, through all servers;
* ``pct_of_ceiling`` = ps aggregate / ceiling aggregate x 100 (= ceiling time / ps time);
* ``pct_of_memcpy`` = ps ``worker_gbps`` / memcpy bandwidth x 100.

Every job runs under a deadline (``--timeout``): its workers exit with code 124 when it passes, the launcher
then stops the whole job, and a last guard here kills whatever it started that is still alive.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from paratrain.bench._timing import cpu_model, format_bytes
from paratrain.bench.allreduce import cpu_busy
from paratrain.ps.sharding import DEFAULT_CHUNK_BYTES

__all__ = [
    "ENGINES",
    "PSBenchOptions",
    "combine_runs",
    "default_iters",
    "memcpy_gbps",
    "parse_consistency",
    "render_table",
    "run_bench",
    "summarize",
]

#: The engines, in the order they run.
ENGINES = ("ps", "ceiling")

_GRACE_S = 3.0


def parse_consistency(text: str) -> tuple[str, int | None]:
    """``bsp``, ``asp`` or ``ssp:S`` as ``(kind, staleness)``; the form ``--consistency`` takes.

    Raises:
        ValueError: with what is accepted.

    Example:
        >>> parse_consistency("bsp"), parse_consistency("SSP:2"), parse_consistency("asp")
        (('bsp', None), ('ssp', 2), ('asp', None))
    """
    kind, colon, bound = text.strip().lower().partition(":")
    if kind in ("bsp", "asp") and not colon:
        return kind, None
    if kind == "ssp" and bound.isdigit():
        return kind, int(bound)
    raise ValueError(
        f"bad consistency {text!r}: use bsp, asp, or ssp:S with a staleness bound S >= 0 (e.g. ssp:2; ssp:0 is bsp)"
    )


def default_iters(nbytes: int) -> int:
    """Timed iterations per size when ``--iters`` is not given: about a second of work per size here."""
    if nbytes <= 64 << 10:
        return 300
    if nbytes <= 1 << 20:
        return 100
    if nbytes <= 16 << 20:
        return 30
    return 10


@dataclass(frozen=True, slots=True, kw_only=True)
class PSBenchOptions:
    """What to measure.

    Attributes:
        workers: worker processes W.
        servers: server processes S (the ceiling job has as many echo ranks).
        sizes: key sizes in bytes (one float32 key each).
        consistency: ``bsp``, ``asp`` or ``ssp:S`` (see :func:`parse_consistency`).
        iters: timed iterations per size (None: :func:`default_iters`).
        warmup: untimed iterations per size.
        repeat: run both engines this many times, interleaved, and report the median run.
        timeout: seconds each job may run before it is stopped.
    """

    workers: int
    servers: int
    sizes: tuple[int, ...]
    consistency: str = "bsp"
    iters: int | None = None
    warmup: int = 3
    repeat: int = 1
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.servers < 1:
            raise ValueError(f"--servers must be at least 1 (a parameter server needs a server), got {self.servers}")
        if not self.sizes or any(s <= 0 or s % 4 for s in self.sizes):
            raise ValueError(f"--size must be positive multiples of 4 bytes, got {list(self.sizes)}")
        parse_consistency(self.consistency)
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"--iters must be at least 1, got {self.iters}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {self.repeat}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")

    def iters_for(self, nbytes: int) -> int:
        """Timed iterations for a size."""
        return self.iters if self.iters is not None else default_iters(nbytes)


@dataclass(slots=True)
class _EngineRun:
    status: str  # "ok" or "error"
    detail: str
    payloads: list[dict[str, Any]]


# -- running the jobs ----------------------------------------------------------------------------------------------


def _children_of(pid: int) -> list[int]:
    """Pids of the live processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


class _Deadline:
    """Kills the process groups this process started if a job outlives its deadline.

    Why, when every worker already has a watchdog: a process that is not ours to instrument (the PS server loop
    of ``paratrain.ps.serve``) could still hang after the workers exit, and ``run_launch`` waits for every
    child. The launcher starts each child in its own process group, so killing the groups of our own children
    stops exactly the job, and ``run_launch`` then returns, reporting the failure.
    """

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        for child in _children_of(os.getpid()):
            with contextlib.suppress(OSError):
                if os.getpgid(child) == child:  # the launcher's children lead their own groups
                    os.killpg(child, signal.SIGKILL)
                else:
                    os.kill(child, signal.SIGKILL)

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _collect(out_dir: str, engine: str, workers: int) -> _EngineRun:
    payloads = []
    for rank in range(workers):
        path = os.path.join(out_dir, f"{engine}-rank{rank}.json")
        try:
            with open(path, encoding="utf-8") as fh:
                payloads.append(json.load(fh))
        except (OSError, ValueError):
            return _EngineRun(
                "error", f"worker {rank} wrote no result (it failed, or ran past --timeout: see its output above)", []
            )
    errors = [f"worker {p['rank']}: {p.get('error', '?')}" for p in payloads if p.get("status") != "ok"]
    if errors:
        return _EngineRun("error", "; ".join(errors), [])
    return _EngineRun("ok", "", payloads)


def _run_engine(engine: str, options: PSBenchOptions, out_dir: str) -> _EngineRun:
    """Runs one engine's job under ``paratrain launch`` and collects what its workers wrote."""
    from paratrain.errors import ConfigError
    from paratrain.launch.run import run_launch

    args = [
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
        "--servers",
        str(options.servers),
    ]
    if engine == "ps":
        cmd = ["python", "-m", "paratrain.bench._ps_worker", *args, "--consistency", options.consistency]
        nproc, servers = options.workers, options.servers
    else:
        cmd = ["python", "-m", "paratrain.bench._ps_ceiling_worker", *args]
        nproc, servers = options.workers + options.servers, 0
    try:
        with _Deadline(options.timeout + 2 * _GRACE_S) as deadline:
            code = run_launch(cmd, nproc=nproc, servers=servers, prefix=False, timeout=options.timeout, grace=_GRACE_S)
    except (ConfigError, OSError) as exc:
        return _EngineRun("error", f"paratrain launch failed to start: {exc}", [])
    run = _collect(out_dir, engine, options.workers)
    if deadline.fired:
        return _EngineRun("error", f"still running after {options.timeout:.0f}s (--timeout); stopped", [])
    if code != 0 and run.status == "ok":
        return _EngineRun("error", f"paratrain launch exited {code} after the workers wrote their results", [])
    if code != 0:
        run.detail = f"paratrain launch exited {code}: {run.detail}"
    return run


def memcpy_gbps(nbytes: int, *, seconds: float = 0.2) -> float:
    """One core's copy bandwidth for ``nbytes`` (``np.copyto``, 10^9 B/s), the median of repeated copies.

    Buffers are touched first so that page faults are not timed, as in the benchmark loops.
    """
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 10_000):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return round(nbytes / statistics.median(times) / 1e9, 3)


# -- numbers and the table -----------------------------------------------------------------------------------------


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(engine: str, payloads: Sequence[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    """One row per size from the per-worker records of one engine (see the module notes for definitions).

    Example:
        >>> rec = lambda t: {"results": [{"bytes": 1000, "chunks": 1, "iters": 2, "total_s": t,
        ...                               "times_s": [t / 2, t / 2], "phases_s": {"x": t}}]}
        >>> row = summarize("ps", [rec(0.002), rec(0.004)], 2)[0]
        >>> row["mean_ms"], row["worker_gbps"], row["aggregate_gbps"]
        (2.0, 0.001, 0.002)
    """
    rows = []
    for index, first in enumerate(payloads[0]["results"]):
        records = [p["results"][index] for p in payloads]
        nbytes, iters = int(first["bytes"]), int(first["iters"])
        mean_s = max(r["total_s"] / max(r["iters"], 1) for r in records)
        slowest = [max(r["times_s"][i] for r in records) for i in range(min(len(r["times_s"]) for r in records))]
        worker_gbps = 2 * nbytes / mean_s / 1e9 if mean_s > 0 else 0.0
        phases = {
            name: round(statistics.fmean(r["phases_s"][name] for r in records) / max(iters, 1) * 1e3, 4)
            for name in first.get("phases_s", {})
        }
        rows.append(
            {
                "engine": engine,
                "bytes": nbytes,
                "size": format_bytes(nbytes),
                "chunks": int(first.get("chunks", 0)),
                "servers_used": int(first.get("servers_used", 0)),
                "iters": iters,
                "mean_ms": round(mean_s * 1e3, 4),
                "p50_ms": round((statistics.median(slowest) if slowest else mean_s) * 1e3, 4),
                "p90_ms": round((_quantile(slowest, 0.9) if slowest else mean_s) * 1e3, 4),
                "worker_gbps": round(worker_gbps, 4),
                "aggregate_gbps": round(worker_gbps * workers, 4),
                "phases_ms": phases,
            }
        )
    return rows


def combine_runs(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of repeated runs of one engine merged: the median of each time, every run's mean kept in ``runs_ms``.

    Why the median of runs: on a shared machine a whole run can land in a slow period (a neighbour's load, a
    migrated vCPU); interleaving the engines' runs and taking the median keeps one bad period from deciding the
    ratio, without hiding the spread. Throughputs are recomputed from the median time.

    Example:
        >>> rows = [[{"bytes": 8, "mean_ms": t, "p50_ms": t, "p90_ms": t, "worker_gbps": 1.0, "aggregate_gbps": 2.0,
        ...           "phases_ms": {"x": t}}] for t in (3, 1, 2)]
        >>> merged = combine_runs(rows)[0]
        >>> merged["mean_ms"], merged["runs_ms"], merged["worker_gbps"]
        (2, [3, 1, 2], 1.5)
    """
    merged = []
    for index, first in enumerate(runs[0]):
        same = [run[index] for run in runs]
        row = dict(first)
        for name in ("mean_ms", "p50_ms", "p90_ms"):
            row[name] = statistics.median(r[name] for r in same)
        row["phases_ms"] = {k: statistics.median(r["phases_ms"][k] for r in same) for k in first["phases_ms"]}
        row["runs_ms"] = [r["mean_ms"] for r in same]
        if row["mean_ms"] > 0 and first["mean_ms"] > 0:
            scale = first["mean_ms"] / row["mean_ms"]
            row["worker_gbps"] = round(first["worker_gbps"] * scale, 4)
            row["aggregate_gbps"] = round(first["aggregate_gbps"] * scale, 4)
        merged.append(row)
    return merged


def _add_ratios(rows: list[dict[str, Any]], memcpy: dict[int, float]) -> None:
    ceiling = {r["bytes"]: r for r in rows if r["engine"] == "ceiling"}
    for row in rows:
        if row["engine"] != "ps":
            continue
        top = ceiling.get(row["bytes"])
        if top is not None and top["aggregate_gbps"] > 0:
            row["pct_of_ceiling"] = round(100 * row["aggregate_gbps"] / top["aggregate_gbps"], 1)
        copy = memcpy.get(row["bytes"], 0.0)
        if copy > 0:
            row["pct_of_memcpy"] = round(100 * row["worker_gbps"] / copy, 1)


def render_table(report: dict[str, Any]) -> str:
    """The report as a text table for people, with the definitions and any failure underneath."""
    machine = report["machine"]
    busy = machine.get("busy_before")
    during = machine.get("others_busy_during")
    processes = report["workers"] + report["servers"]
    lines = [
        f"parameter server push+clock+pull, float32, {_plural(report['workers'], 'worker')} + "
        f"{_plural(report['servers'], 'server')}, "
        f"consistency {report['consistency']}, {report['transport']}",
        f"{machine['cpus']} CPUs ({machine['processor']})"
        + (f", oversubscribed: {processes} processes" if processes > machine["cpus"] else "")
        + f"; load average {machine['load_before'][0]:.2f} before, {machine['load_after'][0]:.2f} after",
        "other work kept the CPUs "
        + (f"{busy:.0%} busy just before the run" if busy is not None else "? busy before the run")
        + (f", {during:.0%} during it (steal included)" if during is not None else ""),
        "",
    ]
    header = (
        f"{'size':>9} {'W':>2} {'S':>2} {'cons.':<6} {'engine':<8} {'chunks':>6} {'iters':>5} {'p50 ms':>9} "
        f"{'p90 ms':>9} {'mean ms':>9} {'worker GB/s':>11} {'total GB/s':>10} {'% ceiling':>9} {'% memcpy':>8}"
    )
    lines += [header, "-" * len(header)]
    memcpy = {m["bytes"]: m["gbps"] for m in report["memcpy"]}
    for nbytes in report["sizes"]:
        rows = sorted((r for r in report["results"] if r["bytes"] == nbytes), key=lambda r: ENGINES.index(r["engine"]))
        label = format_bytes(nbytes)
        for row in rows:
            pct = f"{row['pct_of_ceiling']:>8.1f}%" if "pct_of_ceiling" in row else ""
            pct_copy = f"{row['pct_of_memcpy']:>7.1f}%" if "pct_of_memcpy" in row else ""
            lines.append(
                f"{label:>9} {report['workers']:>2} {report['servers']:>2} {report['consistency']:<6} "
                f"{row['engine']:<8} {row['chunks']:>6} {row['iters']:>5} {row['p50_ms']:>9.3f} {row['p90_ms']:>9.3f} "
                f"{row['mean_ms']:>9.3f} {row['worker_gbps']:>11.3f} {row['aggregate_gbps']:>10.3f} {pct:>9} "
                f"{pct_copy:>8}".rstrip()
            )
            label = ""
        if memcpy.get(nbytes, 0) > 0:
            copy_ms = nbytes / memcpy[nbytes] / 1e6
            lines.append(
                f"{label:>9} {'':>2} {'':>2} {'':<6} {'memcpy':<8} {'':>6} {'':>5} {'':>9} {'':>9} "
                f"{copy_ms:>9.3f} {memcpy[nbytes]:>11.3f}"
            )
        ps = next((r for r in rows if r["engine"] == "ps"), None)
        if ps is not None and ps["phases_ms"]:
            where = ", ".join(f"{k} {v:.3f}" for k, v in ps["phases_ms"].items())
            lines.append(f"{'':>9} ps: ms per iteration in {where} (mean over workers)")
        if ps is not None and 0 < ps.get("servers_used", 0) < report["servers"]:
            lines.append(
                f"{'':>9} note: {ps['chunks']} chunk(s) of {format_bytes(report['chunk_bytes'])}: only "
                f"{ps['servers_used']} of the {report['servers']} servers hold this key"
            )
    if not report["results"]:
        lines.append(f"{'':>9}  (no engine produced results; see the errors below)")
    lines += [
        "",
        "per iteration each worker pushes and pulls `size` bytes: worker GB/s = 2*size/mean time (10^9 B/s);",
        "total GB/s = workers * worker GB/s; p50/p90 over iterations of the slowest worker's time; mean = the",
        "slowest worker's loop time / iters"
        + (f", median of {report['repeat']} interleaved runs;" if report["repeat"] > 1 else ";"),
        "ceiling = the same chunks sent to the same number of echo processes over the same transport and back;",
        "memcpy = np.copyto of `size` bytes in one process (mean ms = one copy; GB/s copied);",
        "% ceiling = ps total / ceiling total; % memcpy = ps worker GB/s / memcpy GB/s (the bound of a",
        "shared-memory PS, which copies each pushed byte in and each pulled byte out once).",
    ]
    for name, info in report["engines"].items():
        if info["status"] != "ok":
            lines.append(f"{name}: {info['status']}: {info['detail']}")
    if max(busy or 0.0, during or 0.0) > 0.2:
        lines.append(
            f"note: other processes kept the CPUs {max(busy or 0.0, during or 0.0):.0%} busy around the run; "
            "timings are noisy — re-run on an idle machine."
        )
    return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _cpu_seconds() -> tuple[float, float] | None:
    """``(busy, total)`` CPU seconds of the whole machine since boot, steal included; None off Linux."""
    try:
        with open("/proc/stat", encoding="utf-8") as fh:
            ticks = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (the job's ranks are direct children)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class _OthersMeter:
    """How busy the other processes on this machine kept the CPUs while we measured.

    Why: the load average counts our own ranks and lags by a minute, and a sample taken before the run misses
    a job that starts during it. The machine's busy time minus ours (and our reaped children's: the launcher's
    ranks) over the same interval is what others, or the hypervisor's steal, took from us.
    """

    def __init__(self) -> None:
        self._start = _cpu_seconds()
        self._own = _own_cpu_seconds()
        self._wall = time.monotonic()

    def fraction(self) -> float | None:
        """Others' share of all CPUs since construction (0..1), or None where it cannot be known."""
        end = _cpu_seconds()
        if self._start is None or end is None:
            return None
        busy = end[0] - self._start[0]
        total = end[1] - self._start[1]
        others = busy - (_own_cpu_seconds() - self._own)
        return round(min(max(others / total, 0.0), 1.0), 3) if total > 0 else None


def _loadavg() -> list[float]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else [0.0, 0.0, 0.0]


# -- the whole run -------------------------------------------------------------------------------------------------


def run_bench(options: PSBenchOptions, *, out: TextIO | None = None) -> tuple[dict[str, Any], int]:
    """Runs both engines (and the memcpy reference) and returns the report (as ``--json`` writes it) and exit code.

    The exit code is 1 if an engine failed, else 0. Blocks for as long as the measurements take: at most about
    ``options.timeout`` per job, ``2 x repeat`` jobs.
    """
    stream = out if out is not None else sys.stdout

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    load_before = _loadavg()
    busy_before = cpu_busy(0.5)
    sizes = ", ".join(format_bytes(s) for s in options.sizes)
    say(f"memcpy: np.copyto in this process, sizes {sizes}")
    memcpy: list[dict[str, Any]] = [
        {"bytes": s, "size": format_bytes(s), "gbps": memcpy_gbps(s)} for s in options.sizes
    ]
    others = _OthersMeter()
    engines: dict[str, dict[str, str]] = {}
    per_engine: dict[str, list[list[dict[str, Any]]]] = {}
    describe = {
        "ps": f"{_plural(options.workers, 'worker')} + {_plural(options.servers, 'server')}, KVStore "
        f"push+clock+pull, {options.consistency}",
        "ceiling": f"{_plural(options.workers, 'worker')} + {_plural(options.servers, 'echo rank')}, transport "
        "send/recv only",
    }
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-ps-") as root:
        for rep in range(options.repeat):
            out_dir = os.path.join(root, f"run{rep}")
            os.mkdir(out_dir)
            prefix = f"[run {rep + 1}/{options.repeat}] " if options.repeat > 1 else ""
            for step, engine in enumerate(ENGINES, 1):
                if engines.get(engine, {}).get("status") == "error":
                    continue  # failed in an earlier run: do not try again
                say(f"{prefix}[{step}/{len(ENGINES)}] {engine}: {describe[engine]}, sizes {sizes}")
                run = _run_engine(engine, options, out_dir)
                engines[engine] = {"status": run.status, "detail": run.detail}
                if run.status == "ok":
                    per_engine.setdefault(engine, []).append(summarize(engine, run.payloads, options.workers))
                else:
                    say(f"    {engine}: {run.status}: {run.detail}")
    busy_during = others.fraction()
    rows = [row for engine in ENGINES if engine in per_engine for row in combine_runs(per_engine[engine])]
    _add_ratios(rows, {m["bytes"]: m["gbps"] for m in memcpy})
    report: dict[str, Any] = {
        "benchmark": "ps",
        "workers": options.workers,
        "servers": options.servers,
        "consistency": options.consistency,
        "dtype": "float32",
        "sizes": list(options.sizes),
        "iters": [options.iters_for(s) for s in options.sizes],
        "warmup": options.warmup,
        "repeat": options.repeat,
        "chunk_bytes": DEFAULT_CHUNK_BYTES,
        "transport": "ZeroMQ (ipc inside one host)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count() or 1,
            "platform": platform.platform(),
            "processor": cpu_model(),
            "python": platform.python_version(),
            "load_before": load_before,
            "busy_before": busy_before,
            "others_busy_during": busy_during,
            "load_after": _loadavg(),
        },
        "definitions": {
            "mean_ms": "slowest worker's loop time / iters; median over `repeat` interleaved runs (runs_ms)",
            "p50_ms/p90_ms": "median / 90th percentile over iterations of the slowest worker's time",
            "worker_gbps": "(bytes pushed + bytes pulled) per second by one worker = 2*bytes/mean, 1e9 B/s",
            "aggregate_gbps": "workers * worker_gbps: bytes all workers push and pull per second",
            "phases_ms": "ps: mean time per iteration in push(), clock() and pull() (the pull also waits for the "
            "push handles), mean over workers; ceiling: the whole send+receive",
            "ceiling": "W workers send every chunk of the same plan to S echo ranks and receive it back, plain "
            "transport isend/irecv, same ZeroMQ transport and process count; no PS logic",
            "pct_of_ceiling": "100 * ps aggregate_gbps / ceiling aggregate_gbps",
            "memcpy": "np.copyto of `bytes` in one process, median, 1e9 B/s copied",
            "pct_of_memcpy": "100 * ps worker_gbps / memcpy gbps (the bound of a shared-memory PS)",
        },
        "engines": engines,
        "memcpy": memcpy,
        "results": rows,
    }
    code = 1 if any(info["status"] == "error" for info in engines.values()) else 0
    return report, code
