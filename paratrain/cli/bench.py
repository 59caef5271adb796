"""``paratrain bench``: measure paratrain's collectives against Gloo and OpenMPI on this machine.

Each benchmark's subcommand is a thin argparse front over its benchmark module (:mod:`paratrain.bench`), in a module
of its own (``paratrain.cli.bench_<name>``) that registers it with ``add_parsers``; :data:`BENCHMARKS` lists them
in the order the help shows them. The report and option helpers they share are :mod:`.bench_common`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from paratrain.cli import (
    bench_allreduce,
    bench_auth,
    bench_chaos,
    bench_consistency,
    bench_ddp_anchor,
    bench_pipeline,
    bench_ps,
    bench_recovery,
    bench_sched,
    bench_sfb_bytes,
    bench_sim,
    bench_soap,
    bench_train,
)

__all__ = ["BENCHMARKS", "add_parser"]

#: Each benchmark's ``add_parsers(bench_sub)``, in the order ``paratrain bench --help`` lists them.
BENCHMARKS: tuple[Callable[[Any], None], ...] = (
    bench_allreduce.add_parsers,
    bench_ps.add_parsers,
    bench_train.add_parsers,
    bench_consistency.add_parsers,
    bench_pipeline.add_parsers,
    bench_soap.add_parsers,
    bench_recovery.add_parsers,
    bench_chaos.add_parsers,
    bench_auth.add_parsers,
    bench_sfb_bytes.add_parsers,
    bench_ddp_anchor.add_parsers,
    bench_sim.add_parsers,  # simulator, scaling
    bench_sched.add_parsers,  # sched
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench`` (and its subcommands) on the ``paratrain`` parser."""
    p = sub.add_parser(
        "bench",
        help="measure paratrain against Gloo, OpenMPI, DDP and the hardware's ceilings on this machine",
        description="Benchmarks of paratrain against reference implementations, measured in the same run.",
    )
    p.set_defaults(func=lambda args: _usage(p))
    bench_sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for add_parsers in BENCHMARKS:
        add_parsers(bench_sub)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
