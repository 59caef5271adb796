"""``paratrain bench sfb-bytes``: bytes per step of allreduce, the parameter server and SFB, vs the cost model."""

from __future__ import annotations

import argparse
from typing import Any

from paratrain.cli.bench_common import print_report
from paratrain.cli.errors import reports_config_errors
from paratrain.errors import ConfigError

__all__ = ["add_parsers"]


def add_parsers(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "sfb-bytes",
        help="bytes per step of allreduce, the parameter server and SFB per layer, measured vs the cost model",
        description=(
            "Trains single fully-connected layers (the FC-heavy MLP's and LeNet-5's) and the whole FC-heavy MLP "
            "under poseidon for a few steps, with P workers over ZeroMQ on loopback, and prints the bytes one "
            "worker sends and receives per step next to paratrain.sfb.cost's prediction."
        ),
    )
    p.add_argument("--workers", type=int, default=4, help="P (default 4)")
    p.add_argument("--batch", type=int, default=64, help="K, rows per worker and step (default 64)")
    p.add_argument("--servers", type=int, default=1, help="parameter servers for the ps rows (default 1)")
    p.add_argument("--steps", type=int, default=3, help="steps measured after the first (default 3)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_sfb_bytes)


@reports_config_errors("bench sfb-bytes")
def _sfb_bytes(args: argparse.Namespace) -> int:
    from paratrain.bench.sfb_bytes import render_bytes, run_bytes_bench

    if min(args.workers, args.batch, args.servers, args.steps) < 1:
        raise ConfigError("--workers, --batch, --servers and --steps must be >= 1")
    report = run_bytes_bench(workers=args.workers, batch=args.batch, servers=args.servers, steps=args.steps)
    return print_report("sfb-bytes", render_bytes(report), report, args.json, 0)
