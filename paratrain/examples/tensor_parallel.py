"""Tensor parallelism on your own model: its linear layers split over the workers, data parallel across the rest.

Run it on 4 workers, 2-way tensor x 2-way data parallel::

    paratrain launch -n 4 -- python -m paratrain.examples.tensor_parallel --tensor 2

The digits MLP (64-512-512-10) has its first two linear layers split as a Megatron-LM pair: the first by its
output features (each worker of a tensor group holds half of its rows), the second by its input features (half of
its columns; the partial outputs are summed by one allreduce); the classifier stays whole. Workers 0-1 and 2-3
form the tensor groups and take the two halves of every batch. After ``--steps`` steps, rank 0 trains the whole
model in this process on the same batches and prints the largest difference between the two models' parameters:
float32 rounding, since any split computes what the whole model computes.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import numpy as np
import torch
from torch.nn import functional as F  # noqa: N812

import paratrain as pt
from paratrain.soap import Mesh
from paratrain.torch.soap import parallelize
from paratrain.train.data import load_dataset
from paratrain.train.models import build_model


def _train(
    model: torch.nn.Module, steps: int, batch: int, rows: slice, after_backward: Callable[[], None] | None = None
) -> float:
    """``steps`` SGD steps with momentum on the digits' first batches (this worker's ``rows`` of each)."""
    data = load_dataset("digits")
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = torch.zeros(())
    for step in range(steps):
        start = (step * batch) % (len(y) - batch)
        xb, yb = x[start : start + batch][rows], y[start : start + batch][rows]
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        if after_backward is not None:
            after_backward()
        optimizer.step()
    return float(loss.detach())


def main() -> None:
    """Trains the split model; rank 0 compares it with the whole model trained alike."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", type=int, default=2, help="workers that split each layer (default 2)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per step, all workers (default 64)")
    args = parser.parse_args()
    ctx = pt.init()
    torch.manual_seed(0)
    whole: torch.nn.Sequential = build_model("mlp", side=8, classes=10)
    mesh = Mesh.for_workers(ctx.world_size, args.tensor)
    model = parallelize(copy.deepcopy(whole), {"1": "column", "3": "row"}, ctx, mesh)  # the whole one stays
    loss = _train(model, args.steps, args.batch_size, model.rows(args.batch_size), model.average_gradients)
    held, total = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in whole.parameters())
    print(f"rank {ctx.rank}: loss on its rows {loss:.4f}, holds {held:,} of the model's {total:,} parameters")
    state = model.full_state()
    if ctx.rank == 0:
        _train(whole, args.steps, args.batch_size, slice(None))
        diff = max(float(np.abs(state[k] - p.detach().numpy()).max()) for k, p in whole.named_parameters())
        print(f"largest difference from the whole model trained in one process: {diff:.1e}", flush=True)
    pt.shutdown()


if __name__ == "__main__":
    main()
