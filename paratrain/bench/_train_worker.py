"""One process of ``paratrain bench train``: times training steps of the MLP or LeNet-5.

Modes: ``single`` (one process, no communication: the ceiling), ``paratrain`` (under ``paratrain launch``,
``DistributedOptimizer(strategy="allreduce")``), ``ddp`` (``torch.nn.parallel.DistributedDataParallel`` over
Gloo; ``RANK``/``WORLD_SIZE``/``MASTER_*`` set by the benchmark). Inputs are random 28x28 images with random
labels (a fixed seed): the speed of a step does not depend on the pixel values, and no dataset is needed.
Writes ``{mode}-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    """Builds the model, runs warm-up then timed steps, writes the timing."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["single", "paratrain", "ddp"], required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    from torch.nn import functional

    from paratrain.train.models import build_model

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    torch.manual_seed(0)
    model = build_model(args.model, side=28, classes=10)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rank, world = 0, 1
    barrier: Any = None
    if args.mode == "paratrain":
        import paratrain as pt
        import paratrain.torch as ptt

        ctx = pt.init()
        rank, world = ctx.rank, ctx.world_size
        ptt.broadcast_parameters(model)
        optimizer = ptt.DistributedOptimizer(optimizer, model=model, strategy="allreduce")
        barrier = ctx.barrier
    elif args.mode == "ddp":
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        barrier = dist.barrier
    gen = torch.Generator().manual_seed(rank)
    xs = torch.rand(8, args.batch_size, 1, 28, 28, generator=gen)
    ys = torch.randint(0, 10, (8, args.batch_size), generator=gen)

    def step(i: int) -> None:
        optimizer.zero_grad()
        functional.cross_entropy(model(xs[i % 8]), ys[i % 8]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    for i in range(args.warmup):
        step(i)
    if barrier is not None:
        barrier()
    start = time.perf_counter()
    for i in range(args.steps):
        step(i)
    elapsed = time.perf_counter() - start
    result = {
        "mode": args.mode,
        "rank": rank,
        "world_size": world,
        "seconds": elapsed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "samples_per_sec": args.steps * args.batch_size / elapsed,
    }
    Path(args.out, f"{args.mode}-rank{rank}.json").write_text(json.dumps(result))
    if args.mode == "paratrain":
        close = getattr(optimizer, "close", None)
        if callable(close):
            close()
        import paratrain as pt

        pt.shutdown()
    elif args.mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
