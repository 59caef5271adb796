"""The processes of ``paratrain sched``: ``python -m paratrain.cli._sched_job lasso|pagerank ...`` on every rank.

Every rank builds the same problem from the same seed (:func:`lasso_problem`, :func:`pagerank_graph`), runs its
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

from paratrain.sched.graph import Graph

__all__ = ["lasso_problem", "pagerank_graph"]


def lasso_problem(data: str, rows: int, *, seed: int = 0, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(X, y) of a Lasso benchmark: a real design whose features are strongly correlated (Fashion-MNIST's 784
    pixels of the first ``rows`` training images, in [0, 1]), or ``"synthetic"``: 784 features in groups of 8
    sharing a latent factor (correlation 0.9 inside a group). y = X b + noise with b sparse (40 nonzeros),
    seeded: the truth is known, the design is the hard part."""
    from paratrain.errors import ConfigError

    rng = np.random.default_rng(seed)
    if data == "fashion-mnist":
        from paratrain.train.data import load_dataset

        images = load_dataset("fashion-mnist", data_dir=data_dir).x_train[:rows]
        x = images.reshape(len(images), -1).astype(np.float64)
    elif data == "synthetic":
        latent = rng.normal(size=(rows, 98))
        x = np.sqrt(0.9) * np.repeat(latent, 8, axis=1) + np.sqrt(0.1) * rng.normal(size=(rows, 784))
    else:
        raise ConfigError(f"--data must be fashion-mnist or synthetic, got {data!r}")
    truth = np.zeros(x.shape[1])
    truth[rng.choice(x.shape[1], 40, replace=False)] = rng.normal(size=40)
    return x, x @ truth + 0.1 * rng.normal(size=len(x))


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
    from paratrain.sched.engine import lasso, shotgun, strads, worker_rows
    from paratrain.sched.lasso import BlockRun

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


def _pagerank(args: argparse.Namespace) -> None:
    import paratrain as pt
    from paratrain.sched.chromatic import block_partition, chromatic_plan
    from paratrain.sched.coloring import color
    from paratrain.sched.vertex import PageRank, run_chromatic

    ctx = pt.init()
    graph = pagerank_graph(args.graph)
    n = graph.num_vertices
    coloring = color(graph, "edge")
    plan = chromatic_plan(graph, coloring, block_partition(n, ctx.world_size))
    began = time.perf_counter()
    part = run_chromatic(ctx, plan, PageRank(graph), np.full(n, 1.0 / n), args.sweeps)
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
                    "sweeps": args.sweeps,
                    "wall_s": wall,
                    "sweep_s": part.seconds,
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
    pagerank = sub.add_parser("pagerank")
    pagerank.add_argument("--graph", default="debian")
    pagerank.add_argument("--sweeps", type=int, default=100)
    pagerank.add_argument("--out", required=True)
    args = p.parse_args(argv)
    (_lasso if args.app == "lasso" else _pagerank)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
