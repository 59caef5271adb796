"""The anchor of ``paratrain bench recovery``: the same training job under ``torchrun --max-restarts 1``.

DDP over Gloo trains the digits MLP exactly as ``paratrain train`` does (same model, seed, data order, batch,
SGD with momentum); rank 0 saves a checkpoint to disk every K steps (atomically: a temporary file, then a
rename), which is how torchrun users recover. On its first life, rank 1 SIGKILLs itself as step ``--kill-step``
begins; torchrun then stops every worker and starts them all again, and they resume from the checkpoint. Every
rank writes one JSON line per event (``ready``, ``step``) to ``--out``, with ``time.time()``, for the benchmark
to measure death -> restarted -> back at the failed step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import numpy as np

from paratrain._exit import exit_with


def main() -> None:
    """One torchrun worker (see the module docstring)."""
    started = time.time()  # before torch is imported: the process is up
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-step", type=int, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from paratrain.train import tasks
    from paratrain.train.data import load_dataset
    from paratrain.train.models import build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    data = load_dataset("digits")
    model = build_model("mlp", side=data.side, classes=data.classes)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    out = Path(args.out)
    ckpt_path = out / "checkpoint.pt"
    step = 0
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    log = (out / f"rank{rank}.jsonl").open("a", encoding="utf-8", buffering=1)
    log.write(json.dumps({"kind": "started", "life": life, "time": started}) + "\n")
    log.write(json.dumps({"kind": "ready", "life": life, "step": step, "time": time.time()}) + "\n")
    per_rank = len(data.y_train) // world
    steps = per_rank // args.batch_size
    for epoch in range(step // steps, args.epochs):
        order = np.random.default_rng(args.seed * 1_000_003 + epoch).permutation(len(data.y_train))
        mine = order[rank * per_rank : (rank + 1) * per_rank]
        for i in range(step - epoch * steps, steps):
            if life == 0 and rank == 1 and step + 1 == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            idx = np.sort(mine[i * args.batch_size : (i + 1) * args.batch_size])
            xb, yb = torch.from_numpy(data.x_train[idx]), torch.from_numpy(data.y_train[idx])
            optimizer.zero_grad()
            tasks.loss(ddp(xb), yb).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            if rank == 0 and step % args.checkpoint_every == 0:
                tmp = out / "checkpoint.tmp"
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
                os.replace(tmp, ckpt_path)
            log.write(json.dumps({"kind": "step", "life": life, "step": step, "time": time.time()}) + "\n")
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_with(main)
