"""Entry point of the ``paratrain`` command: dispatches to the subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from paratrain._exit import exit_with
from paratrain.cli import bench, compare, demo, launch, plan, profile, sched, topology, train

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``paratrain`` and all its subcommands."""
    parser = argparse.ArgumentParser(
        prog="paratrain",
        description=(
            "Distributed training with a choice of synchronisation. Run 'paratrain COMMAND --help' for the "
            "options of each command."
        ),
    )
    parser.add_argument("--version", action="version", version="paratrain 0.1.0")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    launch.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    train.add_parser(sub)
    compare.add_parser(sub)
    topology.add_parser(sub)
    profile.add_parser(sub)
    plan.add_parser(sub)
    sched.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``paratrain`` with ``argv`` (default ``sys.argv[1:]``) and returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    code: int = args.func(args)
    return code


def run() -> None:
    """The ``paratrain`` command: :func:`main` as paratrain's own process (:func:`~paratrain._exit.exit_with`)."""
    exit_with(main)


if __name__ == "__main__":
    run()
