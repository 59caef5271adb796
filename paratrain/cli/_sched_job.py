"""The processes of ``paratrain sched``: ``python -m paratrain.cli._sched_job lasso|mf|pagerank ...`` on every rank.

Parses a rank's flags into its job (:mod:`paratrain.apps.jobs`), which builds the problem
(:mod:`paratrain.apps.problems`), runs its part of the engine, and writes what rank 0 reports.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from paratrain._exit import exit_with
from paratrain.apps.jobs import LassoJob, MFJob, PageRankJob, lasso_job, mf_job, pagerank_job

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the job of one rank as ``argv`` describes it; returns 0 (failures raise)."""
    p = argparse.ArgumentParser(prog="python -m paratrain.cli._sched_job")
    sub = p.add_subparsers(dest="app", required=True)
    lasso = sub.add_parser("lasso")
    lasso.add_argument("--data", default="fashion-mnist")
    lasso.add_argument("--data-dir", default=None)
    lasso.add_argument("--rows", type=int, default=10_000)
    lasso.add_argument("--alpha", type=float, default=0.001)
    lasso.add_argument("--scheduler", choices=("strads", "shotgun"), default="strads")
    lasso.add_argument("--block", type=int, default=8)
    lasso.add_argument("--threshold", type=float, default=0.1)
    lasso.add_argument("--depth", type=int, default=1)
    lasso.add_argument("--max-updates", type=int, default=100_000)
    lasso.add_argument("--target", type=float, default=None)
    lasso.add_argument("--seed", type=int, default=0)
    lasso.add_argument("--out", required=True)
    lasso.add_argument("--progress", default=None)
    mf = sub.add_parser("mf")
    mf.add_argument("--data", default="fashion-mnist")
    mf.add_argument("--data-dir", default=None)
    mf.add_argument("--rows", type=int, default=10_000)
    mf.add_argument("--rank", type=int, default=10)
    mf.add_argument("--lam", type=float, default=1.0)
    mf.add_argument("--picks", type=int, default=200)
    mf.add_argument("--inner", type=int, default=3)
    mf.add_argument("--order", choices=("cyclic", "priority"), default="cyclic")
    mf.add_argument("--target", type=float, default=None)
    mf.add_argument("--seed", type=int, default=0)
    mf.add_argument("--out", required=True)
    mf.add_argument("--progress", default=None)
    pagerank = sub.add_parser("pagerank")
    pagerank.add_argument("--graph", default="debian")
    pagerank.add_argument("--sweeps", type=int, default=100)
    pagerank.add_argument("--tol", type=float, default=1e-10)
    pagerank.add_argument("--progress", default=None)
    pagerank.add_argument("--out", required=True)
    args = p.parse_args(argv)
    fields = {name: value for name, value in vars(args).items() if name != "app"}
    if args.app == "lasso":
        lasso_job(LassoJob(**fields))
    elif args.app == "mf":
        mf_job(MFJob(**fields))
    else:
        pagerank_job(PageRankJob(**fields))
    return 0


if __name__ == "__main__":
    exit_with(main)
