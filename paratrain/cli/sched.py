"""``paratrain sched lasso|mf|pagerank``: model-parallel jobs (STRADS's scheduler, GraphLab's chromatic engine)
run as real processes, with a progress bar, a plot and the single-process anchors beside them."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parser"]

_JOB = "paratrain.cli._sched_job"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``sched`` on the ``paratrain`` parser."""
    p = sub.add_parser(
        "sched",
        help="model-parallel scheduling: Lasso and MF by STRADS's scheduler, PageRank by GraphLab's colours",
        description=(
            "Run a model-parallel job as real processes: 'lasso' (a scheduler rank and W workers holding the "
            "rows; blocks of coordinates chosen by STRADS's priorities and dependency check, or at random as "
            "Shotgun does) against scikit-learn's Lasso; 'mf' (matrix factorisation by CCD++: the scheduler holds H "
            "and picks the rank-1 factor to refine, W workers hold row blocks of R and their rows of W) against the "
            "shrunk SVD's optimum or one process; 'pagerank' (GraphLab's chromatic engine: W workers "
            "update one colour at a time) against networkx and a scipy power iteration."
        ),
    )
    apps = p.add_subparsers(dest="app", required=True, metavar="APP")
    lasso = apps.add_parser("lasso", help="Lasso by scheduled coordinate blocks, against scikit-learn")
    lasso.add_argument(
        "--data", default="fashion-mnist", help="fashion-mnist (pixels as features), synthetic or correlated:NxP"
    )
    lasso.add_argument("--data-dir", default=None, help="where Fashion-MNIST's files are (default Debian's)")
    lasso.add_argument("--rows", type=int, default=10_000, help="examples (default 10000)")
    lasso.add_argument("--alpha", type=float, default=0.001, help="the L1 weight, as scikit-learn's (default 0.001)")
    lasso.add_argument("-w", "--workers", type=int, default=4, help="workers holding rows (default 4; +1 scheduler)")
    lasso.add_argument("--block", type=int, default=8, help="coordinates per round: the parallel degree (default 8)")
    lasso.add_argument("--threshold", type=float, default=0.1, help="largest |correlation| in a block (default 0.1)")
    lasso.add_argument("--depth", type=int, default=1, help="rounds the scheduler plans ahead (default 1)")
    lasso.add_argument(
        "--schedulers", default="strads,shotgun", help="strads and/or shotgun, comma-separated (default both)"
    )
    lasso.add_argument("--max-updates", type=int, default=200_000, help="stop after this many (default 200000)")
    lasso.add_argument("--gap", type=float, default=1e-4, help="stop within this of scikit-learn's optimum (1e-4)")
    lasso.add_argument("--seed", type=int, default=0, help="the data's and the draws' seed")
    lasso.add_argument("--out", default="sched-lasso", help="directory for lasso.json and lasso.png")
    lasso.set_defaults(func=_lasso)
    mf = apps.add_parser("mf", help="matrix factorisation by CCD++ rank-1 picks, against the optimum or one process")
    mf.add_argument(
        "--data", default="fashion-mnist", help="fashion-mnist (dense images x pixels) or power-law:MxN (sparse)"
    )
    mf.add_argument("--data-dir", default=None, help="where Fashion-MNIST's files are (default Debian's)")
    mf.add_argument("--rows", type=int, default=10_000, help="images, for fashion-mnist (default 10000)")
    mf.add_argument("--rank", type=int, default=10, help="factors (default 10)")
    mf.add_argument("--lam", type=float, default=1.0, help="the L2 weight on W and H (default 1.0)")
    mf.add_argument("-w", "--workers", type=int, default=4, help="workers holding rows (default 4; +1 scheduler)")
    mf.add_argument("--picks", type=int, default=200, help="rank-1 picks at most (default 200)")
    mf.add_argument("--inner", type=int, default=3, help="inner iterations per pick (default 3)")
    mf.add_argument("--orders", default="cyclic,priority", help="cyclic and/or priority (default both)")
    mf.add_argument("--gap", type=float, default=1e-3, help="dense data: stop within this of the optimum (1e-3)")
    mf.add_argument("--seed", type=int, default=0, help="the data's and the start's seed")
    mf.add_argument("--out", default="sched-mf", help="directory for mf.json and mf.png")
    mf.set_defaults(func=_mf)
    pagerank = apps.add_parser("pagerank", help="PageRank by the chromatic engine, against networkx and scipy")
    pagerank.add_argument("--graph", default="debian", help="debian (installed packages) or power-law:N")
    pagerank.add_argument("-w", "--workers", type=int, default=2, help="workers (default 2)")
    pagerank.add_argument("--sweeps", type=int, default=100, help="sweeps over every colour at most (default 100)")
    pagerank.add_argument(
        "--tol",
        type=float,
        default=1e-10,
        help="stop when a sweep moves the ranks by < n * tol in L1, as networkx "
        "(default 1e-10, its tolerance here; 0: always --sweeps)",
    )
    pagerank.add_argument("--out", default="sched-pagerank", help="directory for pagerank.json and pagerank.png")
    pagerank.set_defaults(func=_pagerank)


def _launch(argv: list[str], nproc: int, progress: Path | None, total: int, what: str, *, unit: str = "upd") -> None:
    """Runs the job's processes; draws a bar from rank 0's progress lines meanwhile."""
    from tqdm import tqdm

    from paratrain.errors import ConfigError
    from paratrain.launch.run import run_launch

    code: list[int] = []
    job = threading.Thread(
        target=lambda: code.append(run_launch(["python", "-m", _JOB, *argv], nproc=nproc, stdout=sys.stderr)),
        daemon=True,
    )
    job.start()
    with tqdm(total=total, desc=what, unit=unit, file=sys.stderr, disable=progress is None) as bar:
        while job.is_alive():
            job.join(0.2)  # the bar's refresh period, not an ordering of events
            if progress is not None and progress.is_file():
                lines = progress.read_text().splitlines()
                if lines:
                    last = json.loads(lines[-1])
                    bar.n = min(total, int(last["updates"]))
                    bar.set_postfix(objective=f"{last['objective']:.6g}")
                    bar.refresh()
    if not code or code[0]:
        raise ConfigError(
            f"the {what} job failed (exit code {code[0] if code else '?'}); its processes' errors are above"
        )


@reports_config_errors("sched lasso")
def _lasso(args: argparse.Namespace) -> int:
    import numpy as np

    from paratrain.apps.anchors import lasso_anchor
    from paratrain.apps.plots import plot_lasso
    from paratrain.apps.problems import lasso_problem
    from paratrain.errors import ConfigError

    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    if not schedulers or set(schedulers) - {"strads", "shotgun"}:
        raise ConfigError(f"--schedulers takes strads and/or shotgun, got {args.schedulers!r}")
    if args.workers < 1 or args.block < 1:
        raise ConfigError("--workers and --block must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    x, y = lasso_problem(args.data, args.rows, seed=args.seed, data_dir=args.data_dir)
    anchor = lasso_anchor(x, y, args.alpha, args.gap)
    optimum = anchor.optimum
    print(
        f"{args.data}: {x.shape[0]} x {x.shape[1]}, alpha {args.alpha}; scikit-learn's Lasso: objective "
        f"{optimum:.8g} in {anchor.seconds:.2f} s, {np.count_nonzero(anchor.coef)} nonzero coefficients"
    )
    if anchor.to_gap_tol is not None:
        print(f"scikit-learn within {args.gap:g} of its optimum: {anchor.to_gap_s:.2f} s (tol {anchor.to_gap_tol:g})")
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="paratrain-sched-") as tmp:
        for name in schedulers:
            result, progress = Path(tmp) / f"{name}.json", Path(tmp) / f"{name}.progress"
            argv = ["lasso", "--data", args.data, "--rows", str(args.rows), "--alpha", str(args.alpha)]
            argv += ["--scheduler", name, "--block", str(args.block), "--threshold", str(args.threshold)]
            argv += ["--depth", str(args.depth), "--max-updates", str(args.max_updates), "--seed", str(args.seed)]
            argv += ["--target", repr(optimum * (1 + args.gap)), "--out", str(result), "--progress", str(progress)]
            argv += ["--data-dir", args.data_dir] if args.data_dir else []
            _launch(argv, args.workers + 1, progress, args.max_updates, name)
            runs[name] = json.loads(result.read_text())
    print("| scheduler | updates | rounds | mean block | wall (s) | gap to optimum | max |b - b_sklearn| |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, run in runs.items():
        gap = run["objectives"][-1] / optimum - 1
        diff = float(np.abs(np.array(run["beta"]) - anchor.coef).max())
        reached = "" if gap <= args.gap else " (not reached)"
        print(
            f"| {name} | {run['updates'][-1]}{reached} | {len(run['updates'])} | {np.mean(run['block_sizes']):.2f} | "
            f"{run['seconds'][-1]:.2f} | {gap:.2e} | {diff:.2e} |"
        )
    summary = {
        "optimum": optimum,
        "sklearn_s": anchor.seconds,
        "sklearn_to_gap_s": anchor.to_gap_s,
        "args": vars(args) | {"func": None},
        "runs": runs,
    }
    (out / "lasso.json").write_text(json.dumps(summary))
    plot_lasso(runs, optimum, anchor.to_gap_s, args.gap, out / "lasso.png")
    print(f"wrote {out / 'lasso.json'} and {out / 'lasso.png'}")
    return 0


@reports_config_errors("sched mf")
def _mf(args: argparse.Namespace) -> int:
    from paratrain.apps.anchors import mf_anchor
    from paratrain.apps.plots import plot_mf
    from paratrain.apps.problems import mf_problem
    from paratrain.errors import ConfigError

    orders = [s.strip() for s in args.orders.split(",") if s.strip()]
    if not orders or set(orders) - {"cyclic", "priority"}:
        raise ConfigError(f"--orders takes cyclic and/or priority, got {args.orders!r}")
    if args.workers < 1 or args.rank < 1 or args.picks < 1:
        raise ConfigError("--workers, --rank and --picks must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, test = mf_problem(args.data, args.rows, seed=args.seed, data_dir=args.data_dir)
    print(f"{args.data}: {train.shape[0]} x {train.shape[1]}, {train.nnz} entries, rank {args.rank}, lam {args.lam}")
    # dense: the global optimum is the shrunk SVD's; sparse: the same picks in one process, the anchor for the time
    anchor = mf_anchor(
        train, dense=test is None, rank=args.rank, lam=args.lam, picks=args.picks, inner=args.inner, seed=args.seed
    )
    optimum, anchor_s = anchor.optimum, anchor.seconds
    target = None if optimum is None else optimum * (1 + args.gap)
    if optimum is not None:
        print(f"optimum (numpy SVD, singular values shrunk by lam): {optimum:.8g} in {anchor_s:.2f} s")
    else:
        print(f"the same {args.picks} picks in one process (cyclic): {anchor_s:.2f} s")
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="paratrain-sched-") as tmp:
        for order in orders:
            result, progress = Path(tmp) / f"{order}.json", Path(tmp) / f"{order}.progress"
            argv = ["mf", "--data", args.data, "--rows", str(args.rows), "--rank", str(args.rank)]
            argv += ["--lam", str(args.lam), "--picks", str(args.picks), "--inner", str(args.inner)]
            argv += ["--order", order, "--seed", str(args.seed), "--out", str(result), "--progress", str(progress)]
            argv += ["--target", repr(target)] if target is not None else []
            argv += ["--data-dir", args.data_dir] if args.data_dir else []
            _launch(argv, args.workers + 1, progress, args.picks, order, unit="pick")
            runs[order] = json.loads(result.read_text())
    print("| order | picks | rounds | wall (s) | objective | gap to optimum | test RMSE |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for order, run in runs.items():
        final = run["objectives"][-1]
        gap = f"{final / optimum - 1:.2e}" if optimum else "-"
        rmse = f"{run['test_rmse']:.4f}" if run.get("test_rmse") is not None else "-"
        print(
            f"| {order} | {len(run['picks'])} | {run['rounds'][-1]} | {run['seconds'][-1]:.2f} | {final:.8g} | "
            f"{gap} | {rmse} |"
        )
    summary = {"optimum": optimum, "anchor_s": anchor_s, "args": vars(args) | {"func": None}, "runs": runs}
    (out / "mf.json").write_text(json.dumps(summary))
    plot_mf(runs, optimum, out / "mf.png")
    print(f"wrote {out / 'mf.json'} and {out / 'mf.png'}")
    return 0


@reports_config_errors("sched pagerank")
def _pagerank(args: argparse.Namespace) -> int:
    import numpy as np

    from paratrain.apps.anchors import overlapping_updates, pagerank_anchors
    from paratrain.apps.plots import plot_pagerank
    from paratrain.apps.problems import pagerank_graph

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    graph = pagerank_graph(args.graph)
    n = graph.num_vertices
    with tempfile.TemporaryDirectory(prefix="paratrain-sched-") as tmp:
        result = Path(tmp) / "pagerank.json"
        argv = ["pagerank", "--graph", args.graph, "--sweeps", str(args.sweeps), "--tol", repr(args.tol)]
        progress = Path(tmp) / "pagerank.progress"
        argv += ["--out", str(result), "--progress", str(progress)]
        _launch(argv, args.workers, progress, args.sweeps, "pagerank", unit="sweep")
        run = json.loads(result.read_text())
    anchors = pagerank_anchors(graph)
    want = anchors.networkx
    got = np.array(run["values"])
    seen = overlapping_updates(graph, args.workers, run["logs"])
    print(f"{args.graph}: {n} vertices, {graph.num_edges} edges, {run['colors']} colours (edge consistency)")
    print("| method | time (s) | max |x - networkx| |")
    print("|---|---:|---:|")
    print(
        f"| chromatic engine, {args.workers} workers, {run['sweeps']} sweeps | {run['wall_s']:.3f} | "
        f"{np.abs(got - want).max():.2e} |"
    )
    print(f"| networkx pagerank (tol 1e-10) | {anchors.networkx_s:.3f} | 0 |")
    print(
        f"| scipy sparse power iteration ({anchors.power_steps} steps) | {anchors.scipy_s:.3f} | "
        f"{np.abs(anchors.power - want).max():.2e} |"
    )
    print(f"adjacent vertices updated at overlapping times (the engine's log): {seen}")
    (out / "pagerank.json").write_text(
        json.dumps(
            {
                "run": {k: v for k, v in run.items() if k != "logs"},
                "networkx_s": anchors.networkx_s,
                "scipy_s": anchors.scipy_s,
                "overlaps": seen,
                "max_error": float(np.abs(got - want).max()),
                "scipy_changes": anchors.power_changes,
                "scipy_seconds": anchors.power_times,
            }
        )
    )
    plot_pagerank(run, (anchors.power_changes, anchors.power_times), anchors.networkx_s, n, out / "pagerank.png")
    print(f"wrote {out / 'pagerank.json'} and {out / 'pagerank.png'}")
    return 0
