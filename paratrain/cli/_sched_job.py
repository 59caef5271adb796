"""The processes of ``paratrain sched``: ``python -m paratrain.cli._sched_job lasso|mf|pagerank ...`` on every rank.

Every rank builds the same problem from the same seed (:func:`lasso_problem`, :func:`mf_problem`,
:func:`pagerank_graph`), runs its
part of the engine, and rank 0 writes the result as JSON to ``--out`` and, while it runs, a progress line per
round to ``--progress`` (what the command's progress bar follows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from paratrain.sched.graph import Graph

__all__ = ["lasso_problem", "mf_problem", "pagerank_graph"]


def lasso_problem(data: str, rows: int, *, seed: int = 0, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(X, y) of a Lasso benchmark: a real design whose features are strongly correlated (Fashion-MNIST's 784
    pixels of the first ``rows`` training images, in [0, 1]), or ``"synthetic"``: 784 features in groups of 8
    sharing a latent factor (correlation 0.9 inside a group). y = X b + noise with b sparse (40 nonzeros),
    seeded: the truth is known, the design is the hard part. ``"correlated:NxP"``: N rows, P features in groups of
    10 sharing a latent factor (correlation 0.9), P/100 true coefficients of scale 3, noise 0.5: a wide sparse
    problem on which random blocks still converge."""
    from paratrain.errors import ConfigError

    rng = np.random.default_rng(seed)
    if data == "fashion-mnist":
        from paratrain.train.data import load_dataset

        images = load_dataset("fashion-mnist", data_dir=data_dir).x_train[:rows]
        x = images.reshape(len(images), -1).astype(np.float64)
    elif data == "synthetic":
        latent = rng.normal(size=(rows, 98))
        x = np.sqrt(0.9) * np.repeat(latent, 8, axis=1) + np.sqrt(0.1) * rng.normal(size=(rows, 784))
    elif data.startswith("correlated:"):
        shape = data.split(":", 1)[1].split("x")
        if len(shape) != 2 or not all(d.isdigit() and int(d) >= 10 for d in shape):
            raise ConfigError(
                f"--data correlated:NxP takes two numbers >= 10 (e.g. correlated:1000x5000), got {data!r}"
            )
        n, p = int(shape[0]), int(shape[1]) // 10 * 10
        latent = rng.normal(size=(n, p // 10))
        x = np.sqrt(0.9) * np.repeat(latent, 10, axis=1) + np.sqrt(0.1) * rng.normal(size=(n, p))
        truth = np.zeros(p)
        truth[rng.choice(p, p // 100, replace=False)] = 3 * rng.normal(size=p // 100)
        return x, x @ truth + 0.5 * rng.normal(size=n)
    else:
        raise ConfigError(f"--data must be fashion-mnist, synthetic or correlated:NxP, got {data!r}")
    truth = np.zeros(x.shape[1])
    truth[rng.choice(x.shape[1], 40, replace=False)] = rng.normal(size=40)
    return x, x @ truth + 0.1 * rng.normal(size=len(x))


def mf_problem(
    data: str, rows: int, *, seed: int = 0, data_dir: str | None = None
) -> tuple[sp.csr_matrix, sp.csr_matrix | None]:
    """(train, test) of a factorisation benchmark: ``fashion-mnist`` (the first ``rows`` training images as a
    dense rows x 784 matrix, pixels in [0, 1]; no test part: the optimum is the shrunk SVD's) or
    ``power-law:MxN`` (:func:`~paratrain.sched.mf.power_law_ratings`: M x N, power-law row and column counts,
    a planted rank-8 model with noise 0.1, 10 % of the entries held out)."""
    from paratrain.errors import ConfigError
    from paratrain.sched.mf import observed, power_law_ratings

    if data == "fashion-mnist":
        from paratrain.train.data import load_dataset

        images = load_dataset("fashion-mnist", data_dir=data_dir).x_train[:rows]
        return observed(images.reshape(len(images), -1)), None  # every pixel, zeros included, is an entry
    shape = data.split(":", 1)[1].split("x") if data.startswith("power-law:") else []
    if len(shape) != 2 or not all(d.isdigit() and int(d) > 0 for d in shape):
        raise ConfigError(f"--data must be fashion-mnist or power-law:MxN (e.g. power-law:20000x2000), got {data!r}")
    return power_law_ratings(int(shape[0]), int(shape[1]), seed=seed)


def pagerank_graph(name: str) -> Graph:
    """``debian`` (this machine's installed packages) or ``power-law:N`` (N vertices, edges to later vertices)."""
    from paratrain.errors import ConfigError
    from paratrain.sched.graph import debian_dependencies, power_law_graph

    if name == "debian":
        return debian_dependencies()
    if name.startswith("power-law:") and name.split(":", 1)[1].isdigit():
        n = int(name.split(":", 1)[1])
        edges = power_law_graph(n, 3, seed=0).edges()
        return Graph.from_edges(n, edges[edges[:, 0] < edges[:, 1]])
    raise ConfigError(f"--graph must be debian or power-law:N, got {name!r}")


def _progress(path: str | None, record: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _lasso(args: argparse.Namespace) -> None:
    import paratrain as pt
    from paratrain.sched.lasso import BlockRun
    from paratrain.sched.lasso_engine import lasso, shotgun, strads, worker_rows

    ctx = pt.init()
    x, y = lasso_problem(args.data, args.rows, seed=args.seed, data_dir=args.data_dir)
    factory = (
        strads(args.block, threshold=args.threshold, seed=args.seed)
        if args.scheduler == "strads"
        else shotgun(args.block, seed=args.seed)
    )
    rows = (None, None) if ctx.rank == 0 else worker_rows(x, y, ctx.rank, ctx.world_size)
    every = max(1, args.max_updates // args.block // 200)

    def on_round(result: BlockRun) -> None:
        if len(result.updates) % every == 0:
            _progress(args.progress, {"updates": result.updates[-1], "objective": result.objectives[-1]})

    began = time.perf_counter()
    out = lasso(
        ctx,
        *rows,
        alpha=args.alpha,
        make_scheduler=factory,
        max_updates=args.max_updates,
        target=args.target,
        depth=args.depth,
        on_round=on_round,
    )
    if ctx.rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "scheduler": args.scheduler,
                    "workers": ctx.world_size - 1,
                    "block": args.block,
                    "updates": out.updates,
                    "objectives": out.objectives,
                    "seconds": out.seconds,
                    "wall_s": time.perf_counter() - began,
                    "beta": out.beta.tolist(),
                    "block_sizes": [len(b) for b in out.blocks],
                }
            )
        )
    ctx.shutdown()


def _mf(args: argparse.Namespace) -> None:
    import paratrain as pt
    from paratrain.sched.mf import MFRun
    from paratrain.sched.mf_engine import factorize, worker_block

    ctx = pt.init()
    train, test = mf_problem(args.data, args.rows, seed=args.seed, data_dir=args.data_dir)
    rows = None if ctx.rank == 0 else worker_block(train, ctx.rank, ctx.world_size)

    def on_pick(run: MFRun) -> None:
        _progress(args.progress, {"updates": len(run.picks), "objective": run.objectives[-1]})

    began = time.perf_counter()
    out = factorize(
        ctx,
        rows,
        cols=train.shape[1],
        rank=args.rank,
        lam=args.lam,
        picks=args.picks,
        inner=args.inner,
        order=args.order,
        seed=args.seed,
        target=args.target,
        on_pick=on_pick,
    )
    wall = time.perf_counter() - began
    h = ctx.broadcast(out.h if ctx.rank == 0 else np.zeros((train.shape[1], args.rank)), root=0)
    squared = np.zeros(2)  # the held-out entries' squared error and count, this rank's rows
    if out.w is not None and test is not None:
        mine = worker_block(test, ctx.rank, ctx.world_size).tocoo()
        w = out.w
        squared = np.array(
            [float(((mine.data - np.einsum("ij,ij->i", w[mine.row], h[mine.col])) ** 2).sum()), mine.nnz]
        )
    squared = ctx.allreduce(squared)
    if ctx.rank == 0:
        record = {"order": args.order, "workers": ctx.world_size - 1, "picks": out.picks, "wall_s": wall}
        record |= {"objectives": out.objectives, "seconds": out.seconds, "rounds": out.rounds}
        record["test_rmse"] = float(np.sqrt(squared[0] / squared[1])) if squared[1] else None
        Path(args.out).write_text(json.dumps(record))
    ctx.shutdown()


def _pagerank(args: argparse.Namespace) -> None:
    import paratrain as pt
    from paratrain.sched.chromatic import block_partition, chromatic_plan
    from paratrain.sched.coloring import color
    from paratrain.sched.vertex import PageRank, Sweeps, run_chromatic

    ctx = pt.init()
    graph = pagerank_graph(args.graph)
    n = graph.num_vertices
    coloring = color(graph, "edge")
    plan = chromatic_plan(graph, coloring, block_partition(n, ctx.world_size))
    began = time.perf_counter()

    def on_sweep(sweeps: Sweeps) -> None:
        if ctx.rank == 0 and sweeps.changes:
            _progress(args.progress, {"updates": len(sweeps.seconds), "objective": sweeps.changes[-1]})

    part = run_chromatic(
        ctx, plan, PageRank(graph), np.full(n, 1.0 / n), args.sweeps, tol=args.tol or None, on_sweep=on_sweep
    )
    values = np.zeros(n)
    values[part.vertices] = part.values
    values = ctx.allreduce(values)  # each vertex is owned once: the sum assembles the ranks
    wall = time.perf_counter() - began
    mine = np.array([x for entry in part.log for x in entry], dtype=np.float64)  # every worker logs every round
    logs = np.asarray(ctx.allgather(mine)).reshape(ctx.world_size, -1, 3)
    if ctx.rank == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "workers": ctx.world_size,
                    "vertices": n,
                    "edges": graph.num_edges,
                    "colors": coloring.num_colors,
                    "sweeps": len(part.seconds),
                    "wall_s": wall,
                    "sweep_s": part.seconds,
                    "changes": part.changes,
                    "values": values.tolist(),
                    "logs": logs.tolist(),
                }
            )
        )
    ctx.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
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
    {"lasso": _lasso, "mf": _mf, "pagerank": _pagerank}[args.app](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
