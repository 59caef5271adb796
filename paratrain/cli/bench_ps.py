"""``paratrain bench ps``: parameter-server push/clock/pull latency and throughput vs the transport's ceiling."""

from __future__ import annotations

import argparse
import sys

from paratrain.cli.bench_common import options_from, print_report, size_list
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


_PS_EPILOG = """\
Two jobs run one after the other, never at the same time (with --repeat R, R times each, interleaved):
  ps       'paratrain launch -n W --servers S': every worker makes a KVStore with --consistency, inits one
           float32 key per size (cut into 1 MiB chunks over the servers), checks one round, warms up, passes a
           barrier, then times ITERS iterations of push(key, grad) + clock() + pull(key, out=buf);
  ceiling  'paratrain launch -n W+S' with no parameter server: W ranks send the same chunks to S echo ranks and
           receive them back with plain transport send/recv (same transport: on one host ipc headers with the
           data in shared-memory lanes; with --hosts 2 TCP between the emulated hosts; same process count);
and, in this process before and after the jobs (the faster kept), np.copyto of each size (memcpy: the bound
of a shared-memory parameter server).

columns (every worker pushes `size` bytes and pulls `size` bytes per iteration):
  p50, p90     median / 90th percentile over iterations of the slowest worker's time for the iteration
  mean         the slowest worker's loop time / ITERS (with --repeat R: the median of the R runs)
  worker GB/s  bytes pushed + pulled per second by one worker: 2*size / mean (1 GB = 10^9 B)
  total GB/s   all workers together: W * worker GB/s
  % ceiling    ps total GB/s / ceiling total GB/s: what the parameter server keeps of its transport
  % memcpy     ps worker GB/s / memcpy GB/s

--json FILE writes: benchmark, workers, servers, consistency, dtype, sizes, iters, warmup, repeat,
chunk_bytes, transport, date, machine (cpus, processor, platform, python, load_before, busy_before,
others_busy_during, load_after), definitions, engines (ps|ceiling -> status ok|error, detail),
memcpy (rows: bytes, size, gbps) and results (rows: engine, bytes, size, chunks, servers_used, iters,
mean_ms, p50_ms, p90_ms, runs_ms, worker_gbps, aggregate_gbps, phases_ms, and for ps rows pct_of_ceiling,
pct_of_memcpy).

Sizes: 1024, 64KiB or 64K (x1024), 16MB (x1000), comma-separated for several; multiples of 4 bytes. Exit code:
0, or 1 if a job failed, 2 for bad arguments. Timings are only meaningful on an otherwise idle machine.

example:
  paratrain bench ps --workers 2 --servers 2 --size 16MiB --repeat 3 --json ps.json
"""


def _consistency(text: str) -> str:
    from paratrain.bench.ps import parse_consistency

    try:
        kind, bound = parse_consistency(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return kind if bound is None else f"{kind}:{bound}"


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench ps``."""
    p = bench_sub.add_parser(
        "ps",
        help="parameter-server push/clock/pull latency and throughput vs the transport's ceiling",
        description=(
            "Time KVStore push+clock+pull of W workers against S parameter servers, and the same bytes moved by "
            "the same transport without a parameter server (the ceiling), in one run."
        ),
        epilog=_PS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes W (default 2)")
    p.add_argument("--servers", type=int, default=1, help="parameter-server processes S (default 1)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="servers holding each chunk (primary-backup; default 1): run 1 and 2 to measure replication's cost",
    )
    p.add_argument("--size", type=size_list, default=None, help="key size(s), comma-separated (default 16MiB)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: 300 small .. 10 large)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size before timing (default 3)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run both jobs R times, interleaved, and report the median run (default 1; use 3+ on noisy machines)",
    )
    p.add_argument(
        "--consistency",
        type=_consistency,
        default="bsp",
        help="bsp (default), asp, or ssp:S with staleness bound S (pulls wait for the slowest worker under bsp)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        choices=(1, 2),
        default=1,
        help="1 (default): every process on this host; 2: workers and servers on two emulated hosts (network "
        "namespaces joined by a veth pair, TCP between them; needs root)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each job may run (default 300)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every number to FILE as JSON")
    p.set_defaults(func=_ps)


@reports_config_errors("bench ps")
def _ps(args: argparse.Namespace) -> int:
    from paratrain.bench.ps import PSBenchOptions, render_table, run_bench

    options = options_from(PSBenchOptions, args, sizes=tuple(args.size or [16 << 20]))
    try:
        report, code = run_bench(options)
    except RuntimeError as exc:  # --hosts 2: the emulated hosts could not be made (not root, no iproute2...)
        print(f"paratrain bench ps: error: {exc}", file=sys.stderr)
        return 2
    return print_report("ps", render_table(report), report, args.json, code)
