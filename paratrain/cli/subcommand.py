"""One ``paratrain`` subcommand parsed and run on its own, for commands that run another (``bench sched`` runs
``sched``; ``plan --confirm`` trains): through the subcommand's module, never through :mod:`paratrain.cli.main`,
which imports every command (a command importing it would close an import circle)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import ModuleType

__all__ = ["parse_subcommand", "run_subcommand"]


def parse_subcommand(module: ModuleType, argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` (starting with the subcommand's name) parsed by ``module.add_parser`` alone, as ``paratrain`` would.

    Example:
        >>> from paratrain.cli import topology
        >>> parse_subcommand(topology, ["topology", "ring", "--workers", "4"]).workers
        4
    """
    parser = argparse.ArgumentParser(prog="paratrain")
    module.add_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser.parse_args(list(argv))


def run_subcommand(module: ModuleType, argv: Sequence[str]) -> int:
    """Parses ``argv`` as :func:`parse_subcommand` does and runs it; returns its exit code."""
    args = parse_subcommand(module, argv)
    code: int = args.func(args)
    return code
