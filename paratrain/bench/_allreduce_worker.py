"""One rank of ``paratrain bench allreduce``'s paratrain engines; run under ``paratrain launch``.

Engines: ``paratrain`` times the public ``pt.allreduce_(x, algorithm=...)``; ``paratrain-shm`` times
:class:`~paratrain.collectives.shm.ShmGroup` directly (the shared-memory path without the API's per-call
agreement). Each rank writes ``{engine}-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._exit import exit_with
from paratrain.bench._timing import add_worker_args, progress_printer, record_result, run_sizes, start_watchdog


def _api_engine(
    ctx: Any, algorithm: str, operation: str = "allreduce"
) -> tuple[Callable[[npt.NDArray[np.float32]], Callable[[], Any]], Any]:
    """The op factory for ``pt.allreduce_`` with ``algorithm`` (registering the shm path if asked for it), or for
    ``pt.reduce``, ``pt.gather``, ``pt.scatter`` or ``pt.alltoall`` (``operation``; root 0)."""
    import paratrain as pt

    closer = None
    if not hasattr(pt, "allreduce_"):
        raise RuntimeError("this paratrain has no pt.allreduce_ yet")
    registry = getattr(getattr(ctx, "collectives", None), "allreduce_algorithms", None)
    if algorithm == "shm" and registry is not None and "shm" not in registry:
        from paratrain.collectives.api import AllreduceAlgorithm
        from paratrain.collectives.shm import ShmAllreduce

        closer = ShmAllreduce(run_id=ctx.settings.run_id)
        registry["shm"] = AllreduceAlgorithm(closer)

    if algorithm == "gloo":  # torch tensors through the torch.distributed engine (numpy arrays never go there)
        ctx.collectives.use_torch_distributed("gloo")

    def make(buf: npt.NDArray[np.float32]) -> Callable[[], Any]:
        x: Any = buf
        if algorithm == "gloo":
            import torch

            x = torch.from_numpy(buf)
        if operation == "reduce":
            return lambda: pt.reduce(x, root=0)
        if operation == "gather":
            return lambda: pt.gather(x, root=0)
        if operation == "scatter":
            return lambda: pt.scatter(x, root=0)
        if operation == "alltoall":
            return lambda: pt.alltoall(x)

        def op() -> None:
            pt.allreduce_(x, op="sum", algorithm=algorithm)

        return op

    return make, closer


def _time_engine(ctx: Any, engine: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Times one engine on every size, then closes what it opened."""
    from paratrain.collectives.shm import ShmGroup

    closer: Any = None
    try:
        if engine == "paratrain":
            make, closer = _api_engine(ctx, args.algorithm, args.op)
            barrier: Callable[[], None] = ctx.barrier
            label = f"paratrain[{args.algorithm}]" if args.op == "allreduce" else f"paratrain {args.op}"
        elif engine == "paratrain-shm":
            group = ShmGroup.from_context(ctx)
            closer = group
            barrier = group.barrier

            def make(buf: npt.NDArray[np.float32], group: ShmGroup = group) -> Callable[[], None]:
                return lambda: group.allreduce_(buf, "sum")

            label = "paratrain-shm"
        else:
            raise ValueError(f"unknown engine {engine!r}")
        progress = progress_printer(label, ctx.rank)
        return run_sizes(
            args, rank=ctx.rank, world_size=ctx.world_size, make_op=make, barrier=barrier, progress=progress
        )
    finally:
        if closer is not None:
            closer.close()


def main(argv: list[str] | None = None) -> int:
    """Runs the requested engines on every size; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_worker_args(parser)
    parser.add_argument("--algorithm", default="auto", help="algorithm for pt.allreduce_ (default auto)")
    parser.add_argument("--engines", default="paratrain,paratrain-shm", help="engines to run, comma-separated")
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, "paratrain bench worker")

    import paratrain as pt

    ctx = pt.init()
    code = 0
    for engine in [e for e in args.engines.split(",") if e]:
        payload: dict[str, Any] = {"world_size": ctx.world_size, "algorithm": args.algorithm}
        code = record_result(args.out, engine, ctx.rank, payload, functools.partial(_time_engine, ctx, engine, args))
        if code:
            break  # the ranks may now disagree on what comes next: stop here
    pt.shutdown()
    return code


if __name__ == "__main__":
    exit_with(main)
