"""The job of one rank of ``paratrain sched``: build the problem, run this rank's part of the engine, and (rank 0)
write the result as JSON to ``out`` and, while it runs, a progress line per round to ``progress`` (what the
command's progress bar follows). The processes run :mod:`paratrain.cli._sched_job`, which parses their flags."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paratrain.apps.problems import lasso_problem, mf_problem, pagerank_graph

__all__ = ["LassoJob", "MFJob", "PageRankJob", "lasso_job", "mf_job", "pagerank_job"]


@dataclass(frozen=True, slots=True)
class LassoJob:
    """A Lasso job by scheduled coordinate blocks (``paratrain sched lasso``'s options, which say what each is)."""

    out: str
    data: str = "fashion-mnist"
    data_dir: str | None = None
    rows: int = 10_000
    alpha: float = 0.001
    scheduler: str = "strads"
    block: int = 8
    threshold: float = 0.1
    depth: int = 1
    max_updates: int = 100_000
    target: float | None = None
    seed: int = 0
    progress: str | None = None


@dataclass(frozen=True, slots=True)
class MFJob:
    """A matrix factorisation job by CCD++ rank-1 picks (``paratrain sched mf``'s options)."""

    out: str
    data: str = "fashion-mnist"
    data_dir: str | None = None
    rows: int = 10_000
    rank: int = 10
    lam: float = 1.0
    picks: int = 200
    inner: int = 3
    order: str = "cyclic"
    target: float | None = None
    seed: int = 0
    progress: str | None = None


@dataclass(frozen=True, slots=True)
class PageRankJob:
    """A PageRank job on the chromatic engine (``paratrain sched pagerank``'s options)."""

    out: str
    graph: str = "debian"
    sweeps: int = 100
    tol: float = 1e-10
    progress: str | None = None


def _progress(path: str | None, record: dict[str, Any]) -> None:
    """Appends ``record`` as a JSON line to ``path`` (the progress file), if there is one."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def lasso_job(job: LassoJob) -> None:
    """Runs one rank of a Lasso job (rank 0 the scheduler, the others the workers). Collective; blocks."""
    import paratrain as pt
    from paratrain.sched.lasso import BlockRun
    from paratrain.sched.lasso_engine import lasso, shotgun, strads, worker_rows

    ctx = pt.init()
    x, y = lasso_problem(job.data, job.rows, seed=job.seed, data_dir=job.data_dir)
    factory = (
        strads(job.block, threshold=job.threshold, seed=job.seed)
        if job.scheduler == "strads"
        else shotgun(job.block, seed=job.seed)
    )
    rows = (None, None) if ctx.rank == 0 else worker_rows(x, y, ctx.rank, ctx.world_size)
    every = max(1, job.max_updates // job.block // 200)

    def on_round(result: BlockRun) -> None:
        if len(result.updates) % every == 0:
            _progress(job.progress, {"updates": result.updates[-1], "objective": result.objectives[-1]})

    began = time.perf_counter()
    out = lasso(
        ctx,
        *rows,
        alpha=job.alpha,
        make_scheduler=factory,
        max_updates=job.max_updates,
        target=job.target,
        depth=job.depth,
        on_round=on_round,
    )
    if ctx.rank == 0:
        Path(job.out).write_text(
            json.dumps(
                {
                    "scheduler": job.scheduler,
                    "workers": ctx.world_size - 1,
                    "block": job.block,
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


def mf_job(job: MFJob) -> None:
    """Runs one rank of a matrix factorisation job (rank 0 holds H). Collective; blocks."""
    import paratrain as pt
    from paratrain.sched.mf import MFRun
    from paratrain.sched.mf_engine import factorize, worker_block

    ctx = pt.init()
    train, test = mf_problem(job.data, job.rows, seed=job.seed, data_dir=job.data_dir)
    rows = None if ctx.rank == 0 else worker_block(train, ctx.rank, ctx.world_size)

    def on_pick(run: MFRun) -> None:
        _progress(job.progress, {"updates": len(run.picks), "objective": run.objectives[-1]})

    began = time.perf_counter()
    out = factorize(
        ctx,
        rows,
        cols=train.shape[1],
        rank=job.rank,
        lam=job.lam,
        picks=job.picks,
        inner=job.inner,
        order=job.order,
        seed=job.seed,
        target=job.target,
        on_pick=on_pick,
    )
    wall = time.perf_counter() - began
    h = ctx.broadcast(out.h if ctx.rank == 0 else np.zeros((train.shape[1], job.rank)), root=0)
    squared = np.zeros(2)  # the held-out entries' squared error and count, this rank's rows
    if out.w is not None and test is not None:
        mine = worker_block(test, ctx.rank, ctx.world_size).tocoo()
        w = out.w
        squared = np.array(
            [float(((mine.data - np.einsum("ij,ij->i", w[mine.row], h[mine.col])) ** 2).sum()), mine.nnz]
        )
    squared = ctx.allreduce(squared)
    if ctx.rank == 0:
        record = {"order": job.order, "workers": ctx.world_size - 1, "picks": out.picks, "wall_s": wall}
        record |= {"objectives": out.objectives, "seconds": out.seconds, "rounds": out.rounds}
        record["test_rmse"] = float(np.sqrt(squared[0] / squared[1])) if squared[1] else None
        Path(job.out).write_text(json.dumps(record))
    ctx.shutdown()


def pagerank_job(job: PageRankJob) -> None:
    """Runs one rank of a chromatic PageRank job. Collective; blocks."""
    import paratrain as pt
    from paratrain.sched.chromatic import block_partition, chromatic_plan
    from paratrain.sched.coloring import color
    from paratrain.sched.vertex import PageRank, Sweeps, run_chromatic

    ctx = pt.init()
    graph = pagerank_graph(job.graph)
    n = graph.num_vertices
    coloring = color(graph, "edge")
    plan = chromatic_plan(graph, coloring, block_partition(n, ctx.world_size))
    began = time.perf_counter()

    def on_sweep(sweeps: Sweeps) -> None:
        if ctx.rank == 0 and sweeps.changes:
            _progress(job.progress, {"updates": len(sweeps.seconds), "objective": sweeps.changes[-1]})

    part = run_chromatic(
        ctx, plan, PageRank(graph), np.full(n, 1.0 / n), job.sweeps, tol=job.tol or None, on_sweep=on_sweep
    )
    values = np.zeros(n)
    values[part.vertices] = part.values
    values = ctx.allreduce(values)  # each vertex is owned once: the sum assembles the ranks
    wall = time.perf_counter() - began
    mine = np.array([x for entry in part.log for x in entry], dtype=np.float64)  # every worker logs every round
    logs = np.asarray(ctx.allgather(mine)).reshape(ctx.world_size, -1, 3)
    if ctx.rank == 0:
        Path(job.out).write_text(
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
