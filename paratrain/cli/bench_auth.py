"""``paratrain bench auth``: what authentication costs, latency and bandwidth with and without a secret."""

from __future__ import annotations

import argparse

from paratrain.cli.bench_common import options_from, print_report, size_list
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench auth``."""
    p = bench_sub.add_parser(
        "auth",
        help="what authentication costs: latency (4 KiB) and bandwidth (16 MiB) with and without a secret",
        description=(
            "Two processes measure paratrain's round trip and one-way bandwidth over TCP (different host ids) and "
            "ipc (the same host id), without a secret and with one (CURVE on TCP, a checked password on ipc), "
            "every configuration once per round, interleaved; reports the median and min-max over rounds."
        ),
    )
    p.add_argument("--repeat", type=int, default=5, help="rounds of every configuration, interleaved (default 5)")
    p.add_argument("--round-trips", type=int, default=2000, help="timed 4 KiB ping-pongs per run (default 2000)")
    p.add_argument("--messages", type=int, default=8, help="16 MiB messages per bandwidth run (default 8)")
    p.add_argument("--latency-size", type=size_list, default=[4 << 10], help="ping-pong payload (default 4KiB)")
    p.add_argument("--bandwidth-size", type=size_list, default=[16 << 20], help="bulk message size (default 16MiB)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_auth)


@reports_config_errors("bench auth")
def _auth(args: argparse.Namespace) -> int:
    from paratrain.bench.auth import AuthBenchOptions, render, run_auth_bench

    sizes = {"latency_bytes": args.latency_size[0], "bandwidth_bytes": args.bandwidth_size[0]}
    report = run_auth_bench(options_from(AuthBenchOptions, args, **sizes))
    return print_report("auth", render(report), report, args.json, 0)
