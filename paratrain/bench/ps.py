"""``paratrain bench ps``: the parameter server's push/clock/pull against the bytes-only ceiling of its transport.

Two engines run one after the other (never at the same time, so they never share the CPUs), and with
``--repeat R`` R times, interleaved:

* ``ps``: a real job, ``paratrain launch -n W --servers S``. Every worker makes a :class:`~paratrain.ps.KVStore`
  with the chosen consistency, initialises one float32 key of each size (the store cuts it into 1 MiB chunks
  dealt over the servers), checks one round, then times ``iters`` iterations of ``push(key, grad)`` +
  ``clock()`` + ``pull(key, out=buf)`` (:mod:`._ps_worker`).
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
then stops the whole job, and a few seconds later the launcher's own deadline stops whatever still runs (a
server loop is not ours to instrument). The shared harness is in :mod:`.harness`, :mod:`.stats`,
:mod:`.machine` and :mod:`.tables`; this module holds the engines and the columns.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from paratrain.bench import harness, netns, stats, tables
from paratrain.bench._timing import format_bytes
from paratrain.bench.harness import EngineRun, SizedOptions, Step
from paratrain.bench.machine import MachineSample, OthersMeter, machine_report
from paratrain.errors import ConfigError
from paratrain.ps.sharding import DEFAULT_CHUNK_BYTES
from paratrain.strategy import parse_strategy

__all__ = [
    "ENGINES",
    "PSBenchOptions",
    "combine_runs",
    "memcpy_gbps",
    "parse_consistency",
    "render_table",
    "run_bench",
    "summarize",
]

#: The engines, in the order they run.
ENGINES = ("ps", "ceiling")


def parse_consistency(text: str) -> tuple[str, int | None]:
    """``bsp``, ``asp`` or ``ssp:S`` as ``(kind, staleness)``; the form ``--consistency`` takes.

    Raises:
        ValueError: with what is accepted.

    Example:
        >>> parse_consistency("bsp"), parse_consistency("SSP:2"), parse_consistency("asp")
        (('bsp', None), ('ssp', 2), ('asp', None))
    """
    try:
        spec = parse_strategy(text)  # the one parser of strategy names
    except ConfigError:
        spec = None
    if spec is None or not spec.uses_servers:
        raise ConfigError(
            f"bad consistency {text!r}: use bsp, asp, or ssp:S with a staleness bound S >= 0 (e.g. ssp:2; ssp:0 is bsp)"
        )
    return spec.kind, spec.staleness


@dataclass(frozen=True, slots=True, kw_only=True)
class PSBenchOptions(SizedOptions):
    """What to measure (and, from :class:`~paratrain.bench.harness.SizedOptions`: sizes, iters, warmup, repeat,
    timeout).

    Attributes:
        workers: worker processes W.
        servers: server processes S (the ceiling job has as many echo ranks).
        consistency: ``bsp``, ``asp`` or ``ssp:S`` (see :func:`parse_consistency`).
        replicas: servers holding each chunk (``paratrain launch --replicas``): with 2 every push is also
            forwarded to a backup and acknowledged after it; compare ``--replicas 2`` with 1 for its cost.
        hosts: 1: every process on this host (ipc and shared memory between them); 2: the workers on one
            emulated host and the servers (echo ranks) on another (:mod:`.netns`), TCP between them.
    """

    workers: int
    servers: int
    consistency: str = "bsp"
    replicas: int = 1
    hosts: int = 1

    def __post_init__(self) -> None:
        harness.require_at_least_one(self, "workers")
        if self.servers < 1:
            raise ConfigError(f"--servers must be at least 1 (a parameter server needs a server), got {self.servers}")
        if not self.sizes or any(s <= 0 or s % 4 for s in self.sizes):
            raise ConfigError(f"--size must be positive multiples of 4 bytes, got {list(self.sizes)}")
        parse_consistency(self.consistency)
        if not 1 <= self.replicas <= self.servers:
            raise ConfigError(f"--replicas must be 1..{self.servers} (the servers), got {self.replicas}")
        if self.hosts not in (1, 2):
            raise ConfigError(f"--hosts must be 1 or 2, got {self.hosts}")
        if self.hosts == 2 and self.replicas != 1:
            raise ConfigError("--hosts 2 runs without replicas (its jobs start ranks themselves, not the launcher)")
        SizedOptions.__post_init__(self)


# -- running the jobs ----------------------------------------------------------------------------------------------


def _run_engine(
    engine: str, options: PSBenchOptions, hosts: netns.TwoHosts | None, out_dir: str
) -> dict[str, EngineRun]:
    """Runs one engine's job (under ``paratrain launch``, or placed on two emulated hosts) and collects what its
    workers wrote."""
    args = [*harness.worker_args(options, out_dir), "--servers", str(options.servers)]
    if hosts is not None:  # workers on host 0, servers or echo ranks on host 1
        module = "paratrain.bench._ps_worker" if engine == "ps" else "paratrain.bench._ps_ceiling_worker"
        extra = ["--consistency", options.consistency] if engine == "ps" else []
        placement = [0] * options.workers + [1] * options.servers
        env = dict(os.environ, PARATRAIN_TIMEOUT=str(options.timeout))
        commands = netns.placed_commands(
            hosts,
            ["python", "-m", module, *args, *extra],
            placement,
            servers=options.servers if engine == "ps" else 0,
            env=env,
        )
        problem = harness.run_job(commands, timeout=options.timeout, deadline_s=options.deadline_s())
        return harness.judge({engine: harness.collect(out_dir, engine, options.workers, who="worker")}, problem)
    if engine == "ps":
        cmd = ["python", "-m", "paratrain.bench._ps_worker", *args, "--consistency", options.consistency]
        nproc, servers = options.workers, options.servers
        replicas = options.replicas
    else:
        cmd = ["python", "-m", "paratrain.bench._ps_ceiling_worker", *args]
        nproc, servers = options.workers + options.servers, 0
        replicas = 1
    problem = harness.launch_job(
        cmd, nproc=nproc, servers=servers, replicas=replicas, timeout=options.timeout, deadline_s=options.deadline_s()
    )
    return harness.judge({engine: harness.collect(out_dir, engine, options.workers, who="worker")}, problem)


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
        mean_s, slowest = stats.slowest_rank(records)
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
                "p90_ms": round((stats.quantile(slowest, 0.9) if slowest else mean_s) * 1e3, 4),
                "worker_gbps": round(worker_gbps, 4),
                "aggregate_gbps": round(worker_gbps * workers, 4),
                "phases_ms": phases,
            }
        )
    return rows


def combine_runs(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of repeated runs of one engine merged: the median of each time, every run's mean kept in ``runs_ms``.

    Throughputs are recomputed from the median time; see :func:`paratrain.bench.stats.combine_runs` for why the
    median of interleaved runs.

    Example:
        >>> rows = [[{"bytes": 8, "mean_ms": t, "p50_ms": t, "p90_ms": t, "worker_gbps": 1.0, "aggregate_gbps": 2.0,
        ...           "phases_ms": {"x": t}}] for t in (3, 1, 2)]
        >>> merged = combine_runs(rows)[0]
        >>> merged["mean_ms"], merged["runs_ms"], merged["worker_gbps"]
        (2, [3, 1, 2], 1.5)
    """
    return stats.combine_runs(
        runs,
        times=("mean_ms", "p50_ms", "p90_ms"),
        rates=("worker_gbps", "aggregate_gbps"),
        runs_key="runs_ms",
        nested=("phases_ms",),
    )


def _add_ratios(rows: list[dict[str, Any]], memcpy: dict[int, float]) -> None:
    ceiling = {r["bytes"]: r["aggregate_gbps"] for r in rows if r["engine"] == "ceiling"}
    for row in rows:
        if row["engine"] != "ps":
            continue
        of_ceiling = stats.ratio(row["aggregate_gbps"], ceiling.get(row["bytes"]), scale=100, digits=1)
        if of_ceiling is not None:
            row["pct_of_ceiling"] = of_ceiling
        # small keys on a loaded machine reach well under 0.1 % of memcpy: kept to 4 places, not rounded to 0
        of_memcpy = stats.ratio(row["worker_gbps"], memcpy.get(row["bytes"]), scale=100, digits=4)
        if of_memcpy is not None:
            row["pct_of_memcpy"] = of_memcpy


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
        tables.cpus(machine)
        + (f", oversubscribed: {processes} processes" if processes > machine["cpus"] else "")
        + f"; {tables.load(machine)}",
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
    definitions = [
        "per iteration each worker pushes and pulls `size` bytes: worker GB/s = 2*size/mean time (10^9 B/s);",
        "total GB/s = workers * worker GB/s; p50/p90 over iterations of the slowest worker's time; mean = the",
        "slowest worker's loop time / iters" + tables.rounds_note(report["repeat"]),
        "ceiling = the same chunks sent to the same number of echo processes over the same transport and back;",
        "memcpy = np.copyto of `size` bytes in one process (mean ms = one copy; GB/s copied);",
        "% ceiling = ps total / ceiling total; % memcpy = ps worker GB/s / memcpy GB/s (the bound of a",
        "shared-memory PS, which copies each pushed byte in and each pulled byte out once).",
    ]
    lines += tables.footer(report, definitions, busy=max(busy or 0.0, during or 0.0), when="around the run")
    return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


# -- the whole run -------------------------------------------------------------------------------------------------


def run_bench(options: PSBenchOptions, *, out: TextIO | None = None) -> tuple[dict[str, Any], int]:
    """Runs both engines (and the memcpy reference) and returns the report (as ``--json`` writes it) and exit code.

    The exit code is 1 if an engine failed, else 0. Blocks for as long as the measurements take: at most about
    ``options.timeout`` per job, ``2 x repeat`` jobs.
    """
    stream = out if out is not None else sys.stdout

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    before = MachineSample.take()
    sizes = ", ".join(format_bytes(s) for s in options.sizes)
    say(f"memcpy: np.copyto in this process, sizes {sizes}")
    memcpy: list[dict[str, Any]] = [
        {"bytes": s, "size": format_bytes(s), "gbps": memcpy_gbps(s)} for s in options.sizes
    ]
    others = OthersMeter()
    describe = {
        "ps": f"{_plural(options.workers, 'worker')} + {_plural(options.servers, 'server')}, KVStore "
        f"push+clock+pull, {options.consistency}",
        "ceiling": f"{_plural(options.workers, 'worker')} + {_plural(options.servers, 'echo rank')}, transport "
        "send/recv only",
    }
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(netns.two_hosts()) if options.hosts == 2 else None
        if hosts is not None:
            say(
                f"two emulated hosts: workers in {hosts.namespaces[0]} ({hosts.addresses[0]}), servers and echo ranks "
                f"in {hosts.namespaces[1]} ({hosts.addresses[1]}), TCP over a veth pair"
            )
        steps = [
            Step(
                (engine,),
                f"{engine}: {describe[engine]}, sizes {sizes}",
                functools.partial(_run_engine, engine, options, hosts),
            )
            for engine in ENGINES
        ]
        rounds = harness.run_rounds(
            steps,
            repeat=options.repeat,
            summarize=lambda label, payloads: summarize(label, payloads, options.workers),
            say=say,
            tmp_prefix="paratrain-bench-ps-",
        )
    busy_during = others.fraction()
    for entry in memcpy:  # once more after the jobs: the faster of the two is the ceiling (a busy start skews one)
        entry["gbps"] = max(entry["gbps"], memcpy_gbps(entry["bytes"]))
    rows = [row for engine in ENGINES if engine in rounds.rows for row in combine_runs(rounds.rows[engine])]
    _add_ratios(rows, {m["bytes"]: m["gbps"] for m in memcpy})
    report: dict[str, Any] = {
        "benchmark": "ps",
        "workers": options.workers,
        "servers": options.servers,
        "replicas": options.replicas,
        "consistency": options.consistency,
        "dtype": "float32",
        "sizes": list(options.sizes),
        "iters": [options.iters_for(s) for s in options.sizes],
        "warmup": options.warmup,
        "repeat": options.repeat,
        "chunk_bytes": DEFAULT_CHUNK_BYTES,
        "hosts": options.hosts,
        "transport": "ZeroMQ: ipc headers and shared-memory lanes inside one host"
        if options.hosts == 1
        else "ZeroMQ over TCP between two emulated hosts (network namespaces, veth)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_report(before, {"others_busy_during": busy_during}),
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
            "memcpy": "np.copyto of `bytes` in one process, median, 1e9 B/s copied; measured before and after the "
            "jobs, the faster kept",
            "pct_of_memcpy": "100 * ps worker_gbps / memcpy gbps (the bound of a shared-memory PS)",
        },
        "engines": rounds.engines,
        "memcpy": memcpy,
        "results": rows,
    }
    return report, harness.exit_code(rounds.engines)
