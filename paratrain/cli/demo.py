"""``paratrain demo``: launch N local ranks that pass barriers, and report the job's total time."""

from __future__ import annotations

import argparse
import time

from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``demo`` on the ``paratrain`` parser."""
    p = sub.add_parser(
        "demo",
        help="launch N local ranks that pass barriers, and time the whole job",
        description=(
            "Launch N ranks on this host (as 'paratrain launch' does); each joins the job, passes the "
            "barriers and prints one line. Reports the wall time of the whole job: start-up, rendezvous, "
            "barriers and shutdown."
        ),
    )
    p.add_argument("-n", "--nproc", type=int, default=4, help="number of ranks (default 4)")
    p.add_argument("--barriers", type=int, default=10, help="barriers each rank passes (default 10)")
    p.set_defaults(func=_main)


@reports_config_errors("demo")
def _main(args: argparse.Namespace) -> int:
    from paratrain.launch.run import run_launch

    t0 = time.perf_counter()
    code = run_launch(
        ["python", "-m", "paratrain.examples.barriers", "--barriers", str(args.barriers)],
        nproc=args.nproc,
    )
    elapsed = time.perf_counter() - t0
    status = "ok" if code == 0 else f"FAILED (exit {code})"
    print(f"paratrain demo: {args.nproc} ranks, {args.barriers} barriers each: {status}; whole job {elapsed:.2f} s")
    return code
