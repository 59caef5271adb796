"""A training loop that survives a crashed worker: reliable allreduce, in-memory checkpoints, replay.

Run it with a failure on purpose::

    paratrain launch -n 2 --max-restarts 1 --kill 1@step=7 -- python -m paratrain.examples.resilient

Rank 1 dies as its 7th step begins; the launcher restarts it from a warm spare, it loads the newest checkpoint
from rank 0's memory, replays the allreduce results since, and both finish with the same parameters as a run
without the kill (each rank prints a SHA-256 of them). Least squares on fixed synthetic data, so it needs only
numpy and torch; the same pattern is what ``paratrain train --max-restarts`` runs.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import paratrain as pt
import paratrain.torch as ptt
from paratrain.recovery import Reliable
from paratrain.torch.resilient import (
    parameters_digest,
    reliable_broadcast_parameters,
    restore_training_state,
    training_state,
)


def main() -> None:
    """Trains a linear model on this rank's share of the data, checkpointing every ``--every`` steps."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--every", type=int, default=5, help="steps between in-memory checkpoints (default 5)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = pt.init()
    rel = Reliable(ctx)  # first, before any other collective: a restarted rank catches up here
    opt = ptt.DistributedOptimizer(optimizer, model=model, reliable=rel)
    ckpt = rel.load_checkpoint()
    if ckpt is None:
        reliable_broadcast_parameters(model, rel)
    else:
        restore_training_state(model, optimizer, ckpt)
    start = int(ckpt.meta["step"]) if ckpt is not None else 0
    for step in range(start, args.steps):
        # the data of a step depend on the step and the rank only, so a replay sees what the first run saw
        rng = np.random.default_rng([step, ctx.rank])
        x = torch.from_numpy(rng.standard_normal((16, 8)).astype(np.float32))
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        if (step + 1) % args.every == 0:
            rel.checkpoint(training_state(model, optimizer), {"step": step + 1})
    restarts = len(rel.recoveries)
    print(f"rank {rel.ctx.rank}: {args.steps} steps, {restarts} recoveries, parameters {parameters_digest(model)}")
    pt.shutdown()


if __name__ == "__main__":
    main()
