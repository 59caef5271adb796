"""What authentication costs (``paratrain bench auth``): latency and bandwidth with and without it, TCP and ipc.

Two processes, started once and reused by every configuration, open a fresh pair of
:class:`~paratrain.transport.zmq.ZmqTransport` per configuration and measure through paratrain's own send and
receive (encoding, zero-copy above 64 KiB, the receiver thread, the matching engine), as a job would:

* **latency**: ``round_trips`` ping-pongs of a ``latency_bytes`` array (4 KiB), after a warm-up; the run's value is
  the median round trip;
* **bandwidth**: rank 0 sends ``messages`` arrays of ``bandwidth_bytes`` (16 MiB) back to back, rank 1 answers
  once it has them all; the run's value is their bytes over that time;
* **connect**: from rank 0's ``connect()`` until its link's handshake is complete (``wait_linked``): what
  authentication adds to a job's start and to every re-formation after a failure.

Configurations: TCP (the ranks get different host ids, as on two hosts) and ipc (the same host id), each with no
secret (plain ZeroMQ) and with one (CURVE on TCP, PLAIN with a derived password on ipc: see
:mod:`paratrain.transport.auth`). Every repeat runs every configuration once, in turn, so that a slow period of a
shared machine hits them all alike; the report gives the median and the spread (min, max) over repeats.
"""

from __future__ import annotations

import multiprocessing
import secrets
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from paratrain.bench import tables
from paratrain.bench.machine import MachineSample, OthersMeter, machine_report
from paratrain.bench.stats import median_spread
from paratrain.errors import ConfigError

__all__ = ["CONFIGS", "AuthBenchOptions", "render", "run_auth_bench"]

#: (name, transport, authenticated), in the order every repeat runs them.
CONFIGS: tuple[tuple[str, str, bool], ...] = (
    ("tcp", "tcp", False),
    ("tcp+curve", "tcp", True),
    ("ipc", "ipc", False),
    ("ipc+plain", "ipc", True),
)
_TAG_PING, _TAG_BULK, _TAG_ACK = 1, 2, 3


@dataclass(frozen=True, slots=True, kw_only=True)
class AuthBenchOptions:
    """What ``paratrain bench auth`` measures.

    Attributes:
        latency_bytes: payload of a ping-pong (default 4 KiB).
        round_trips: timed ping-pongs per run (after ``round_trips // 10`` untimed ones).
        bandwidth_bytes: size of one bulk message (default 16 MiB).
        messages: bulk messages per run (after one untimed).
        repeat: runs of every configuration, interleaved.
        timeout: seconds any single step may take before the benchmark gives up.
    """

    latency_bytes: int = 4 << 10
    round_trips: int = 2000
    bandwidth_bytes: int = 16 << 20
    messages: int = 8
    repeat: int = 5
    timeout: float = 120.0

    def __post_init__(self) -> None:
        for name in ("latency_bytes", "round_trips", "bandwidth_bytes", "messages", "repeat"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.latency_bytes % 4 or self.bandwidth_bytes % 4:
            raise ConfigError("sizes must be multiples of 4 bytes (float32 arrays)")


def _peer(rank: int, conn: Any, options: AuthBenchOptions) -> None:
    """One of the two processes: for each command from the parent, a fresh transport pair and one measurement."""
    from paratrain.transport.zmq import ZmqTransport

    while conn.poll(options.timeout * 4):
        command = conn.recv()
        if command is None:
            return
        kind, secret = command
        host = "bench-host" if kind == "ipc" else f"bench-host-{rank}"
        transport = ZmqTransport(
            rank=rank, world_size=2, host_id=host, run_id="bench-auth", timeout=options.timeout, secret=secret
        )
        try:
            conn.send(transport.endpoints())
            if not conn.poll(options.timeout):
                return
            table = conn.recv()
            start = time.perf_counter()
            transport.connect(table)
            transport.wait_linked(options.timeout)
            linked_ms = (time.perf_counter() - start) * 1e3
            conn.send({**_measure(transport, rank, options), "connect_ms": linked_ms})
        finally:
            transport.close()


def _measure(transport: Any, rank: int, options: AuthBenchOptions) -> dict[str, Any]:
    """Rank 0 drives, rank 1 echoes; returns rank 0's timings (rank 1: an empty dict)."""
    ping = np.ones(options.latency_bytes // 4, dtype=np.float32)
    bulk = np.ones(options.bandwidth_bytes // 4, dtype=np.float32)
    other, t = 1 - rank, options.timeout
    warmup = max(1, options.round_trips // 10)
    if rank == 1:
        for _ in range(warmup + options.round_trips):
            msg = transport.recv(0, _TAG_PING, timeout=t)
            transport.send(0, _TAG_PING, msg.arrays)
        for i in range(1 + options.messages):
            transport.recv(0, _TAG_BULK, timeout=t)
            if i == 0:  # the warm-up message
                transport.send(0, _TAG_ACK)
        transport.send(0, _TAG_ACK)
        return {}
    times = []
    for i in range(warmup + options.round_trips):
        start = time.perf_counter()
        transport.send(other, _TAG_PING, [ping])
        transport.recv(other, _TAG_PING, timeout=t)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    transport.send(other, _TAG_BULK, [bulk])  # warm-up: buffers, page faults, TCP window
    transport.recv(other, _TAG_ACK, timeout=t)
    start = time.perf_counter()
    handles = [transport.isend(other, _TAG_BULK, [bulk]) for _ in range(options.messages)]
    for handle in handles:
        handle.wait(t)
    transport.recv(other, _TAG_ACK, timeout=t)
    elapsed = time.perf_counter() - start
    return {
        "rtt_us": statistics.median(times) * 1e6,
        "rtt_mean_us": statistics.fmean(times) * 1e6,
        "bandwidth_mbps": options.messages * options.bandwidth_bytes / elapsed / 1e6,
    }


def _ask(conn: Any, timeout: float, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"paratrain bench auth: no {what} from a peer process within {timeout:.0f}s")
    return conn.recv()


def run_auth_bench(options: AuthBenchOptions, *, progress: bool = True) -> dict[str, Any]:
    """Runs every configuration ``options.repeat`` times, interleaved, in two processes; returns the report.

    Raises:
        TimeoutError: a peer process did not answer within ``options.timeout`` seconds.
    """
    before = MachineSample.take()
    meter = OthersMeter()
    mp = multiprocessing.get_context("spawn")
    pipes = [mp.Pipe() for _ in range(2)]
    procs = [mp.Process(target=_peer, args=(r, pipes[r][1], options), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in CONFIGS}
    try:
        for round_ in range(options.repeat):
            for name, kind, authenticated in CONFIGS:
                secret = secrets.token_bytes(32) if authenticated else None
                for parent, _ in pipes:
                    parent.send((kind, secret))
                table = [_ask(parent, options.timeout, "endpoints") for parent, _ in pipes]
                for parent, _ in pipes:
                    parent.send(table)
                answers = [_ask(parent, options.timeout * 2, "result") for parent, _ in pipes]
                result = answers[0]  # rank 0 drives and times; rank 1 answers {}
                runs[name].append(result)
                if progress:
                    print(
                        f"round {round_ + 1}/{options.repeat} {name:>10}: rtt {result['rtt_us']:7.1f} us, "
                        f"{result['bandwidth_mbps']:7.0f} MB/s, connect {result['connect_ms']:5.1f} ms",
                        flush=True,
                    )
        for parent, _ in pipes:
            parent.send(None)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for name, kind, authenticated in CONFIGS:
        rows = runs[name]
        results.append(
            {
                "config": name,
                "transport": kind,
                "authenticated": authenticated,
                "rtt_us": median_spread([r["rtt_us"] for r in rows]),
                "bandwidth_mbps": median_spread([r["bandwidth_mbps"] for r in rows]),
                "connect_ms": median_spread([r["connect_ms"] for r in rows]),
                "runs": rows,
            }
        )
    return {
        "benchmark": "auth",
        "options": asdict(options),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine_report(before, {"others_busy_during": meter.fraction()}),
        "results": results,
    }


def _cell(stat: Mapping[str, float] | None, fmt: str) -> str:
    if stat is None:
        return "-"
    return f"{stat['median']:{fmt}} ({stat['min']:{fmt}}-{stat['max']:{fmt}})"


def _cost(base: Mapping[str, Any], row: Mapping[str, Any], key: str) -> str:
    """``row``'s median relative to ``base``'s, as a signed percentage."""
    if base[key] is None or row[key] is None:
        return "-"
    return f"{row[key]['median'] / base[key]['median'] - 1:+.0%}"


def render(report: Mapping[str, Any]) -> str:
    """The report as a table: per configuration, round trip and bandwidth with their spread and the cost."""
    opts = report["options"]
    by_name = {r["config"]: r for r in report["results"]}
    lines = [
        f"{'config':<10} {'rtt 4 KiB (us)':>24} {'vs plain':>9} {'bandwidth 16 MiB (MB/s)':>26} {'vs plain':>9} "
        f"{'connect (ms)':>20}",
    ]
    baseline: Sequence[str] = ("tcp", "tcp", "ipc", "ipc")
    for (name, _, _), base_name in zip(CONFIGS, baseline, strict=True):
        row, base = by_name[name], by_name[base_name]
        lines.append(
            f"{name:<10} {_cell(row['rtt_us'], '.1f'):>24} {_cost(base, row, 'rtt_us'):>9} "
            f"{_cell(row['bandwidth_mbps'], '.0f'):>26} {_cost(base, row, 'bandwidth_mbps'):>9} "
            f"{_cell(row['connect_ms'], '.1f'):>20}"
        )
    machine = report["machine"]
    lines += [
        "",
        f"rtt: median round trip of {opts['round_trips']} ping-pongs of {opts['latency_bytes']} bytes; bandwidth: "
        f"{opts['messages']} x {opts['bandwidth_bytes']} bytes one way, then an answer;",
        "connect: from connect() until the handshake is done;",
        f"median (min-max) of {opts['repeat']} interleaved runs; 'vs plain': the median against the same transport "
        "without a secret.",
        f"{tables.cpus(machine)}; {tables.load(machine)}",
        *tables.noise_note(machine.get("others_busy_during"), "during the run"),
    ]
    return "\n".join(lines)
