"""A training script written for Horovod's PyTorch API, run on paratrain by its import line alone.

Every Horovod idiom is here: ``hvd.init()``, a ``DistributedSampler`` over ``hvd.size()`` replicas, the learning
rate scaled by the number of ranks, ``broadcast_parameters`` and ``broadcast_optimizer_state`` from rank 0,
``hvd.DistributedOptimizer`` (optionally with fp16 compression or Adasum) and the test metrics averaged with
``hvd.allreduce``. The data is scikit-learn's bundled digits (no download).

Run: ``paratrain launch -n 2 -- python -m paratrain.examples.horovod_digits [--fp16-allreduce] [--use-adasum]``
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import paratrain.horovod as hvd  # the only line that differs from the Horovod version: import horovod.torch as hvd


def main() -> None:
    """Trains a small MLP on 80 % of digits and reports the accuracy on the rest, averaged over the ranks."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch per rank (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one rank (default 0.05)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="16-bit gradients on the wire")
    parser.add_argument("--use-adasum", action="store_true", help="combine the ranks' steps by Adasum")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    train, test = TensorDataset(x[:1440], y[:1440]), TensorDataset(x[1440:], y[1440:])
    train_sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        test, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test, batch_size=100, sampler=test_sampler)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    lr_scaler = 1 if args.use_adasum else hvd.size()  # Adasum needs no larger learning rate
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = functional.cross_entropy(model(data), target)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        model.eval()
        correct, total = torch.zeros(()), torch.zeros(())
        with torch.no_grad():
            for data, target in test_loader:
                correct += (model(data).argmax(1) == target).sum()
                total += len(target)
        accuracy = hvd.allreduce(correct / total, name="avg_accuracy")  # Average, Horovod's default
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test accuracy {100 * float(accuracy):.2f}% ({hvd.size()} ranks)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
