"""``paratrain sched lasso|mf|pagerank``: model-parallel jobs (STRADS's scheduler, GraphLab's chromatic engine)
run as real processes, with a progress bar, a plot and the single-process anchors beside them."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
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
    from sklearn.linear_model import Lasso

    from paratrain.cli._sched_job import lasso_problem
    from paratrain.errors import ConfigError
    from paratrain.sched.lasso import lasso_objective

    schedulers = [s.strip() for s in args.schedulers.split(",") if s.strip()]
    if not schedulers or set(schedulers) - {"strads", "shotgun"}:
        raise ConfigError(f"--schedulers takes strads and/or shotgun, got {args.schedulers!r}")
    if args.workers < 1 or args.block < 1:
        raise ConfigError("--workers and --block must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    x, y = lasso_problem(args.data, args.rows, seed=args.seed, data_dir=args.data_dir)
    began = time.perf_counter()
    reference = Lasso(alpha=args.alpha, fit_intercept=False, tol=1e-10, max_iter=100_000).fit(x, y)
    sklearn_s = time.perf_counter() - began
    optimum = lasso_objective(x, y, reference.coef_, args.alpha)
    print(
        f"{args.data}: {x.shape[0]} x {x.shape[1]}, alpha {args.alpha}; scikit-learn's Lasso: objective "
        f"{optimum:.8g} in {sklearn_s:.2f} s, {np.count_nonzero(reference.coef_)} nonzero coefficients"
    )
    for tol in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-8):  # its time to the gap: the loosest tolerance that reaches it
        began = time.perf_counter()
        coef = Lasso(alpha=args.alpha, fit_intercept=False, tol=tol, max_iter=100_000).fit(x, y).coef_
        to_gap_s = time.perf_counter() - began
        if lasso_objective(x, y, coef, args.alpha) <= optimum * (1 + args.gap):
            print(f"scikit-learn within {args.gap:g} of its optimum: {to_gap_s:.2f} s (tol {tol:g})")
            break
    else:
        to_gap_s = sklearn_s
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
        diff = float(np.abs(np.array(run["beta"]) - reference.coef_).max())
        reached = "" if gap <= args.gap else " (not reached)"
        print(
            f"| {name} | {run['updates'][-1]}{reached} | {len(run['updates'])} | {np.mean(run['block_sizes']):.2f} | "
            f"{run['seconds'][-1]:.2f} | {gap:.2e} | {diff:.2e} |"
        )
    summary = {
        "optimum": optimum,
        "sklearn_s": sklearn_s,
        "sklearn_to_gap_s": to_gap_s,
        "args": vars(args) | {"func": None},
        "runs": runs,
    }
    (out / "lasso.json").write_text(json.dumps(summary))
    _plot_lasso(runs, optimum, to_gap_s, args.gap, out / "lasso.png")
    print(f"wrote {out / 'lasso.json'} and {out / 'lasso.png'}")
    return 0


def _plot_lasso(runs: dict[str, Any], optimum: float, sklearn_s: float, gap: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_updates, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        above = [max(o / optimum - 1, 1e-12) for o in run["objectives"]]
        by_updates.plot(run["updates"], above, label=name)
        by_time.plot(run["seconds"], above, label=name)
    by_time.axvline(sklearn_s, color="gray", linestyle="--", label=f"scikit-learn within {gap:g} (1 process)")
    by_updates.set_xscale("log")  # a diverging run ends within its first rounds: visible on a log axis
    for ax, xlabel in ((by_updates, "coordinate updates"), (by_time, "wall time (s)")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("objective / optimum - 1")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@reports_config_errors("sched mf")
def _mf(args: argparse.Namespace) -> int:
    from paratrain.cli._sched_job import mf_problem
    from paratrain.errors import ConfigError
    from paratrain.sched.mf import ccdpp, svd_optimum

    orders = [s.strip() for s in args.orders.split(",") if s.strip()]
    if not orders or set(orders) - {"cyclic", "priority"}:
        raise ConfigError(f"--orders takes cyclic and/or priority, got {args.orders!r}")
    if args.workers < 1 or args.rank < 1 or args.picks < 1:
        raise ConfigError("--workers, --rank and --picks must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, test = mf_problem(args.data, args.rows, seed=args.seed, data_dir=args.data_dir)
    print(f"{args.data}: {train.shape[0]} x {train.shape[1]}, {train.nnz} entries, rank {args.rank}, lam {args.lam}")
    optimum, anchor_s, target = None, None, None
    if test is None:  # dense: the global optimum is the shrunk SVD's
        began = time.perf_counter()
        optimum = svd_optimum(train.toarray(), args.rank, args.lam)
        anchor_s = time.perf_counter() - began
        target = optimum * (1 + args.gap)
        print(f"optimum (numpy SVD, singular values shrunk by lam): {optimum:.8g} in {anchor_s:.2f} s")
    else:  # sparse: the same picks in one process, the anchor for the time
        began = time.perf_counter()
        ccdpp(train, args.rank, args.lam, picks=args.picks, inner=args.inner, seed=args.seed)
        anchor_s = time.perf_counter() - began
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
    _plot_mf(runs, optimum, out / "mf.png")
    print(f"wrote {out / 'mf.json'} and {out / 'mf.png'}")
    return 0


def _plot_mf(runs: dict[str, Any], optimum: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_picks, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        values = [o / optimum - 1 if optimum else o for o in run["objectives"]]
        by_picks.plot(range(1, len(values) + 1), values, label=name)
        by_time.plot(run["seconds"], values, label=name)
    for ax, xlabel in ((by_picks, "rank-1 picks"), (by_time, "wall time (s)")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("objective / optimum - 1" if optimum else "objective")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@reports_config_errors("sched pagerank")
def _pagerank(args: argparse.Namespace) -> int:
    import networkx as nx
    import numpy as np
    import scipy.sparse as sp

    from paratrain.cli._sched_job import pagerank_graph
    from paratrain.sched.chromatic import block_partition, chromatic_plan
    from paratrain.sched.coloring import color
    from paratrain.sched.vertex import overlaps

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
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(map(tuple, graph.edges().tolist()))
    began = time.perf_counter()
    ranks = nx.pagerank(g, alpha=0.85, tol=1e-10, max_iter=1000)
    networkx_s = time.perf_counter() - began
    want = np.array([ranks[v] for v in range(n)])
    edges = graph.edges()
    out_degree = graph.out_degree().astype(np.float64)
    matrix = sp.csr_matrix((1.0 / out_degree[edges[:, 0]], (edges[:, 1], edges[:, 0])), shape=(n, n))
    began = time.perf_counter()
    power, sweeps_power, power_changes, power_times = np.full(n, 1.0 / n), 0, [], []
    while True:
        sweeps_power += 1
        nxt = 0.15 / n + 0.85 * (matrix @ power + power[out_degree == 0].sum() / n)
        power_changes.append(float(np.abs(nxt - power).sum()))
        power_times.append(time.perf_counter() - began)
        done = power_changes[-1] < n * 1e-10 or sweeps_power >= 1000
        power = nxt
        if done:
            break
    scipy_s = time.perf_counter() - began
    got = np.array(run["values"])
    coloring = color(graph, "edge")
    plan = chromatic_plan(graph, coloring, block_partition(n, args.workers))
    seen = overlaps(graph, plan.owner, [[tuple(e) for e in log] for log in run["logs"]], coloring.colors)
    print(f"{args.graph}: {n} vertices, {graph.num_edges} edges, {run['colors']} colours (edge consistency)")
    print("| method | time (s) | max |x - networkx| |")
    print("|---|---:|---:|")
    print(
        f"| chromatic engine, {args.workers} workers, {run['sweeps']} sweeps | {run['wall_s']:.3f} | "
        f"{np.abs(got - want).max():.2e} |"
    )
    print(f"| networkx pagerank (tol 1e-10) | {networkx_s:.3f} | 0 |")
    print(f"| scipy sparse power iteration ({sweeps_power} steps) | {scipy_s:.3f} | {np.abs(power - want).max():.2e} |")
    print(f"adjacent vertices updated at overlapping times (the engine's log): {seen}")
    (out / "pagerank.json").write_text(
        json.dumps(
            {
                "run": {k: v for k, v in run.items() if k != "logs"},
                "networkx_s": networkx_s,
                "scipy_s": scipy_s,
                "overlaps": seen,
                "max_error": float(np.abs(got - want).max()),
                "scipy_changes": power_changes,
                "scipy_seconds": power_times,
            }
        )
    )
    _plot_pagerank(run, (power_changes, power_times), networkx_s, n, out / "pagerank.png")
    print(f"wrote {out / 'pagerank.json'} and {out / 'pagerank.png'}")
    return 0


def _plot_pagerank(
    run: dict[str, Any], power: tuple[list[float], list[float]], networkx_s: float, n: int, path: Path
) -> None:
    """Each sweep's L1 change against sweeps and against wall time: the engine beside the scipy power iteration,
    networkx's whole run as a line."""
    import itertools

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_sweeps, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    engine_times = list(itertools.accumulate(run["sweep_s"]))[: len(run["changes"])]
    label = f"chromatic engine, {run['workers']} workers"
    by_sweeps.plot(range(1, len(run["changes"]) + 1), run["changes"], label=label)
    by_sweeps.plot(range(1, len(power[0]) + 1), power[0], label="scipy power iteration")
    by_time.plot(engine_times, run["changes"], label=label)
    by_time.plot(power[1], power[0], label="scipy power iteration")
    by_time.axvline(networkx_s, color="gray", linestyle="--", label="networkx pagerank (whole run)")
    for ax, xlabel in ((by_sweeps, "sweeps / power steps"), (by_time, "wall time (s)")):
        ax.axhline(n * 1e-10, color="black", linewidth=0.6, label="stop: n x 1e-10")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("L1 change of the ranks")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
