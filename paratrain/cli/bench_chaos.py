"""``paratrain bench chaos``: random kill schedules over every strategy, each run classified."""

from __future__ import annotations

import argparse
import sys
import tempfile

from paratrain.cli.bench_common import print_report
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench chaos``."""
    p = bench_sub.add_parser(
        "chaos",
        help="kill a random worker at a random step or time, over every strategy: bitwise, accurate, failed fast...",
        description=(
            "Runs paratrain train (digits MLP, two epochs) once per strategy without a failure, then --runs jobs "
            "with one --kill drawn at random (the strategies in turn; a worker, a step or a time), those that "
            "recover with --max-restarts 1, and classifies each: finished bitwise equal to the fault-free model, "
            "finished accurate (SSP/ASP: another model, within 0.05 of the fault-free test accuracy), finished "
            "with another model, failed fast (with the seconds it took), hung (stopped at --deadline), or no "
            "death (the job ended before its kill). Exits 1 if any run hung or finished with another model where "
            "its strategy recovers. About 5 s a run."
        ),
    )
    p.add_argument("--runs", type=int, default=22, help="chaos runs (default 22: each strategy twice)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the drawn schedules (default 0)")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds before a run counts as hung (default 120)")
    p.add_argument(
        "--torchrun", type=int, default=5, help="runs of the torchrun --max-restarts anchor (default 5; 0: none)"
    )
    p.add_argument(
        "--strategies",
        default=None,
        metavar="LIST",
        help="comma-separated strategies to draw from, in turn (default: every kind, as STRATEGIES in "
        "paratrain/bench/chaos.py lists them)",
    )
    p.add_argument("--out", default=None, help="where the runs' directories go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_chaos)


@reports_config_errors("bench chaos")
def _chaos(args: argparse.Namespace) -> int:
    from paratrain.bench.chaos import STRATEGIES, render, run_chaos
    from paratrain.errors import ConfigError
    from paratrain.strategy import parse_strategy

    if args.runs < 1 or args.deadline <= 0 or args.torchrun < 0:
        raise ConfigError("--runs must be >= 1, --deadline > 0 and --torchrun >= 0")
    strategies = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else STRATEGIES
    for name in strategies:
        parse_strategy(name)  # a ConfigError names what is wrong
    with tempfile.TemporaryDirectory(prefix="paratrain-chaos-") as scratch:
        found = run_chaos(
            args.out or scratch, runs=args.runs, seed=args.seed, deadline=args.deadline, torchrun=args.torchrun,
            strategies=strategies,
            say=lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
    bad = [r for r in found["runs"] if r["outcome"] == "hung" or (r["outcome"] == "differs" and r["restarts"])]
    return print_report("chaos", render(found), found, args.json, 1 if bad else 0)
