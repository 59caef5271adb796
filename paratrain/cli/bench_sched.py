"""``paratrain bench sched``: the model-parallel scheduling benchmarks of ``benchmarks/sched/`` in one command.

Each benchmark is a ``paratrain sched`` command (which runs its anchors in the same process: scikit-learn, the
shrunk SVD, networkx, scipy); this runs the list one after another, never two at once, each writing its JSON and
figure into its own folder under ``--out`` and its printed tables into a ``.txt`` beside it. The list is
:func:`suite`, the one copy of the benchmark's settings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from typing import Any

from paratrain.cli.errors import reports_config_errors
from paratrain.errors import ConfigError

__all__ = ["add_parsers", "suite"]

APPS = ("lasso", "mf", "pagerank")


def suite(out: str, *, quick: bool = False) -> list[tuple[str, list[str]]]:
    """(name, ``paratrain`` arguments) of every benchmark, in order; ``quick``: small sizes (a minute in all)."""
    lasso = ["sched", "lasso", "--workers", "4", "--block", "8"]
    mf = ["sched", "mf", "--workers", "4", "--rank", "10"]
    fmnist, wide = (
        (["2000", "30000"], ["correlated:300x1000", "100000"])
        if quick
        else (["10000", "600000"], ["correlated:1000x5000", "2000000"])
    )
    dense, sparse = (["1000", "100"], "power-law:2000x500") if quick else (["10000", "400"], "power-law:20000x2000")
    runs = [
        (
            "lasso-fmnist",
            [*lasso, "--data", "fashion-mnist", "--alpha", "0.001", "--rows", fmnist[0], "--max-updates", fmnist[1]],
        ),
        ("lasso-wide", [*lasso, "--data", wide[0], "--alpha", "0.1", "--max-updates", wide[1]]),
        ("mf-fmnist", [*mf, "--data", "fashion-mnist", "--rows", dense[0], "--picks", dense[1]]),
        ("mf-powerlaw", [*mf, "--data", sparse, "--lam", "5", "--picks", "100"]),
    ]
    for graph in ["debian", "power-law:5000"] if quick else ["debian", "power-law:20000", "power-law:100000"]:
        for workers in (2, 4):
            name = f"pagerank-{graph.replace(':', '-')}-w{workers}"
            runs.append((name, ["sched", "pagerank", "--graph", graph, "--workers", str(workers), "--sweeps", "100"]))
    return [(name, [*argv, "--out", f"{out}/{name}"]) for name, argv in runs]


def add_parsers(bench_sub: Any) -> None:
    """Registers ``sched`` under ``paratrain bench``."""
    p = bench_sub.add_parser(
        "sched",
        help="model-parallel scheduling: STRADS Lasso and MF, chromatic PageRank, against their anchors",
        description=(
            "Runs the benchmarks of benchmarks/sched/ one after another: Lasso on Fashion-MNIST pixels and on a "
            "wide correlated design (STRADS vs random blocks, against scikit-learn), CCD++ matrix factorisation "
            "on dense Fashion-MNIST and a sparse power-law matrix, and PageRank by the chromatic engine on the "
            "Debian dependency graph and power-law graphs (against networkx and scipy). Each writes its JSON, "
            "figure and printed tables under --out."
        ),
    )
    p.add_argument("--out", default="bench-sched", help="folder for the results (default bench-sched)")
    p.add_argument("--only", default=",".join(APPS), help="lasso, mf and/or pagerank (default all three)")
    p.add_argument("--quick", action="store_true", help="small sizes: checks the suite runs, in about a minute")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.set_defaults(func=_run)


@reports_config_errors("bench sched")
def _run(args: argparse.Namespace) -> int:
    from paratrain.cli import sched
    from paratrain.cli.subcommand import run_subcommand

    only = {a.strip() for a in args.only.split(",") if a.strip()}
    if not only or only - set(APPS):
        raise ConfigError(f"--only takes {', '.join(APPS)}, got {args.only!r}")
    runs = [(name, argv) for name, argv in suite(args.out, quick=args.quick) if argv[1] in only]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name, argv in runs:
        print("paratrain " + " ".join(argv), flush=True)
        if args.dry_run:
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
            code = run_subcommand(sched, argv)
        (Path(args.out) / f"{name}.txt").write_text(printed.getvalue())
        if code:
            return code
    return 0


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy (a benchmark's tables go to both)."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
