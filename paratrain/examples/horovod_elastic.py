"""A Horovod elastic script, unchanged but for its import: it goes on when a worker dies and takes the worker's
replacement back when it is ready.

    paratrain launch -n 3 --min-workers 2 --max-restarts 1 --no-spare --kill 1@step=6 \\
        -- python -m paratrain.examples.horovod_elastic

Rank 1 dies after its sixth step. The others' collectives fail; each restores its last commit, and the two re-form
as a job of 2 that goes on from there. The replacement, started cold, is taken in at the next commit, receives
rank 0's model, optimizer and position, and the job ends as 3. Each step's global batch of ``--batch`` examples
is shared among the ranks there are. Every rank prints its size, the resets it went through, its test accuracy
and a digest of its parameters (the same on every rank).
"""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch.nn import functional

import paratrain.horovod as hvd


def main() -> None:
    """Trains the digits MLP under ``hvd.elastic.run``; prints this rank's outcome."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="epochs over the training examples (default 3)")
    parser.add_argument("--batch", type=int, default=60, help="examples per step, all ranks together (default 60)")
    parser.add_argument("--commit-every", type=int, default=4, help="steps between commits (default 4)")
    parser.add_argument(
        "--sampler",
        action="store_true",
        help="read the data through a DataLoader with hvd.elastic.ElasticSampler (batches of --batch / 3 per rank)",
    )
    parser.add_argument(
        "--until-joined",
        action="store_true",
        help="after --epochs, go on (an epoch at a time, at most 1000) until every launched worker is back",
    )
    args = parser.parse_args()
    hvd.init()
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    train_x, train_y, test_x, test_y = x[:1500], y[:1500], x[1500:], y[1500:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters()
    )
    steps = len(train_y) // args.batch
    launched = int(os.environ.get("WORLD_SIZE", hvd.size()))  # as launched (paratrain launch sets it)
    dataset = torch.utils.data.TensorDataset(train_x, train_y)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    per_rank = max(1, args.batch // launched)
    loader = torch.utils.data.DataLoader(dataset, batch_size=per_rank, sampler=sampler)
    samplers = {"train_sampler": sampler} if args.sampler else {}
    state = hvd.elastic.TorchState(model, optimizer, **samplers, epoch=0, batch=0, resets=0)
    state.register_reset_callbacks([lambda: setattr(state, "resets", state.resets + 1)])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs or (args.until_joined and hvd.size() < launched and state.epoch < 1000):
            order = np.random.default_rng(state.epoch).permutation(len(train_y))
            while state.batch < steps:
                batch = order[state.batch * args.batch : (state.batch + 1) * args.batch]
                mine = torch.from_numpy(batch[hvd.rank() :: hvd.size()])
                _step(train_x[mine], train_y[mine])
                state.batch += 1
                if state.batch % args.commit_every == 0:
                    state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    @hvd.elastic.run
    def train_sampled(state: hvd.elastic.TorchState) -> None:  # Horovod's elastic examples' pattern
        while state.epoch < args.epochs or (args.until_joined and hvd.size() < launched and state.epoch < 1000):
            for i, (xb, yb) in enumerate(loader):
                _step(xb, yb)
                state.train_sampler.record_batch(i, per_rank)
                state.batch += 1
                if state.batch % args.commit_every == 0:
                    state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.train_sampler.set_epoch(state.epoch)
            state.commit()

    def _step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        optimizer.zero_grad()
        functional.cross_entropy(model(xb), yb).backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    (train_sampled if args.sampler else train)(state)
    with torch.no_grad():
        accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    print(f"rank {hvd.rank()} of {hvd.size()}: {state.epoch} epochs, {state.resets} resets, accuracy {accuracy:.4f}, "
          f"parameters {digest}", flush=True)  # fmt: skip
    hvd.shutdown()


if __name__ == "__main__":
    main()
