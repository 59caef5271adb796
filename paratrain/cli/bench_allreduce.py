"""``paratrain bench allreduce``: allreduce time and bandwidth per size, paratrain vs Gloo vs OpenMPI."""

from __future__ import annotations

import argparse

from paratrain.cli.bench_common import options_from, print_report, size_list
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


_ALLREDUCE_EPILOG = """\
Engines run one after another, never at the same time: paratrain (pt.allreduce_ with --algorithm, and the
shared-memory path directly as 'paratrain-shm') under 'paratrain launch', then torch.distributed with Gloo,
then OpenMPI through mpi4py under mpirun. A missing anchor (no torch, no mpi4py or mpirun) is skipped with a
note. All engines allreduce float32 buffers with sum, check the result once, warm up, then time ITERS calls back
to back.

columns:
  time      mean time per call of the back-to-back calls, slowest rank (as nccl-tests averages);
            with --repeat R, the median of R runs of each engine, interleaved with the other engines
  p50       median over calls of the slowest rank's time for that call
  algbw     size / time;  busbw = algbw * 2(N-1)/N (nccl-tests), comparable across N
  X/this    anchor X's time / this row's time: > 1 means paratrain is faster

--json FILE writes: benchmark, np, dtype, op, algorithm, sizes, compare, repeat, date, machine (cpus,
processor, platform, python, load_before, busy_before, load_after), timing (the definitions), engines (name -> status
ok|skipped|error, detail) and results (rows: engine, bytes, size, iters, time_us, p50_us, runs_us, algbw_gbps,
busbw_gbps, and for paratrain rows ratios {anchor: anchor time / this time}).

Sizes: 1024, 4KiB or 4K (x1024), 16MB (x1000); multiples of 4 bytes. Exit code: 0, or 1 if an engine failed,
2 for bad arguments. Timings are only meaningful on an otherwise idle machine.

example:
  paratrain bench allreduce --np 2 --sizes 4KiB,1MiB,16MiB,64MiB --compare gloo,mpi --json out.json
"""


def _compare(text: str) -> list[str]:
    from paratrain.bench.allreduce import ANCHORS

    names = [] if text.strip().lower() in ("", "none") else [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in ANCHORS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown anchor {', '.join(bad)}; choose from {', '.join(ANCHORS)} or none")
    return list(dict.fromkeys(names))


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench allreduce``."""
    a = bench_sub.add_parser(
        "allreduce",
        help="allreduce time and bandwidth per size: paratrain vs Gloo vs OpenMPI",
        description="Time allreduce of N local ranks for each size with paratrain, Gloo and OpenMPI.",
        epilog=_ALLREDUCE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("--np", dest="nproc", type=int, default=2, help="ranks (processes) per engine (default 2)")
    a.add_argument(
        "--sizes", type=size_list, default=None, help="comma-separated sizes (default 4KiB,1MiB,16MiB,64MiB)"
    )
    a.add_argument(
        "--compare",
        type=_compare,
        default=None,
        help="anchors: gloo,mpi,horovod (default; each skipped where not installed), a subset, or none",
    )
    a.add_argument("--iters", type=int, default=None, help="timed calls per size (default: 500 small .. 10 large)")
    a.add_argument("--warmup", type=int, default=5, help="untimed calls per size before timing (default 5)")
    a.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every engine R times, interleaved, and report the median run (default 1; use 3+ on noisy machines)",
    )
    a.add_argument(
        "--algorithm",
        default="auto",
        choices=("auto", "ring", "tree", "direct", "halving_doubling", "torus", "double_tree", "shm", "gloo"),
        help="algorithm= of pt.allreduce_ (default auto; shm is registered if the API lacks it; gloo: torch tensors "
        "through paratrain's torch.distributed engine)",
    )
    a.add_argument("--no-shm", action="store_true", help="do not time the shared-memory path directly")
    a.add_argument(
        "--op",
        default="allreduce",
        choices=("allreduce", "reduce", "gather", "scatter", "alltoall"),
        help="the collective (default allreduce); reduce, gather, scatter (root 0) and alltoall against MPI's, "
        "a size being one rank's block",
    )
    a.add_argument("--timeout", type=float, default=600.0, help="seconds each engine may run (default 600)")
    a.add_argument("--json", metavar="FILE", default=None, help="write every number to FILE as JSON")
    a.set_defaults(func=_allreduce)


@reports_config_errors("bench allreduce")
def _allreduce(args: argparse.Namespace) -> int:
    from paratrain.bench.allreduce import ANCHORS, DEFAULT_SIZES, BenchOptions, render_table, run_bench
    from paratrain.bench.harness import parse_sizes

    sizes = tuple(args.sizes or parse_sizes(DEFAULT_SIZES))
    compare = tuple(ANCHORS if args.compare is None else args.compare)
    options = options_from(BenchOptions, args, sizes=sizes, compare=compare, shm=not args.no_shm, op=args.op)
    report, code = run_bench(options)
    return print_report("allreduce", render_table(report), report, args.json, code)
