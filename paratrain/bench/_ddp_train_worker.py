"""One process of ``paratrain bench ddp-anchor``: trains like ``paratrain train`` does, with torch DDP over Gloo.

The same model, data, shards (:func:`paratrain.train.shards.step_share`), SGD with momentum 0.9, learning rate
and seed as a ``paratrain train`` run, with DDP's gradient compression as the only difference under test:
``--hook none`` (plain allreduce), ``fp16`` (``fp16_compress_hook``) or ``powersgd:R`` (``powerSGD_hook`` with
rank R, error feedback and warm start, compressing from the second step, the earliest DDP allows; in one bucket,
see below). Rank 0 writes ``ddp.json``: every
epoch's end time (training time only, evaluation excluded) and test accuracy, and the step times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from paratrain._exit import exit_with


def main(argv: list[str] | None = None) -> int:
    """Trains, evaluates after each epoch, writes the record on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="widemlp")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps-per-epoch", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hook", default="none")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from paratrain.train import tasks
    from paratrain.train.data import load_dataset
    from paratrain.train.models import build_model
    from paratrain.train.shards import step_share

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    data = load_dataset(args.dataset, data_dir=args.data_dir)
    model = build_model(args.model, side=data.side, classes=data.classes)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    # PowerSGD's hook issues each bucket's second allreduce (Q) from a future's callback; with several buckets on
    # Gloo those callbacks race and the ranks' allreduces mismatch ("Received data size doesn't match expected
    # size", or a hang: seen here with the default buckets). One bucket (an explicit cap makes DDP's first bucket
    # as large as the others) keeps every rank's calls in one order; it costs the hook its overlap with backward
    single = args.hook.startswith("powersgd:")
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024 if single else None)
    state: Any = None
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook.startswith("powersgd:"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(args.hook.split(":", 1)[1]),
            start_powerSGD_iter=2,  # DDP requires >= 2 (its first iteration builds the buckets); as early as allowed
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif args.hook != "none":
        raise SystemExit(f"unknown --hook {args.hook!r}: none, fp16 or powersgd:R")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    per_rank = len(data.y_train) // world
    steps = per_rank // args.batch_size
    if args.steps_per_epoch > 0:
        steps = min(steps, args.steps_per_epoch)
    epochs, step_times, training = [], [], 0.0
    for epoch in range(args.epochs):
        order = np.random.default_rng(args.seed * 1_000_003 + epoch).permutation(len(data.y_train))
        dist.barrier()
        start = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            share = step_share(order, shards=world, batch=args.batch_size, step=i, world_size=world, rank=rank)
            xb, yb = torch.from_numpy(data.x_train[share.indices]), torch.from_numpy(data.y_train[share.indices])
            optimizer.zero_grad()
            tasks.loss(ddp(xb), yb).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step_times.append(time.perf_counter() - t0)
        dist.barrier()
        training += time.perf_counter() - start
        accuracy, _ = tasks.evaluate(model, data.x_test, data.y_test)
        epochs.append(
            {"epoch": epoch + 1, "steps": (epoch + 1) * steps, "train_s": training, "test_accuracy": accuracy}
        )
    if rank == 0:
        samples = args.epochs * steps * args.batch_size * world
        record = {
            "hook": args.hook,
            "workers": world,
            "model": args.model,
            "dataset": args.dataset,
            "batch_size": args.batch_size,
            "steps": args.epochs * steps,
            "samples_per_sec": samples / training,
            "step_s_median": float(np.median(step_times)),
            "epochs": epochs,
        }
        Path(args.out, "ddp.json").write_text(json.dumps(record, indent=2))
    dist.destroy_process_group()
    # As in _train_worker: torch 2.13's Gloo sometimes hangs the interpreter's exit after destroy_process_group, and
    # the anchor would then wait out its timeout for a run whose result is written. Leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    exit_with(main)
