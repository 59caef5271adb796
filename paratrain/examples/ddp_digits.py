"""A PyTorch DDP training script that runs on torch.distributed or on paratrain, the two side by side.

The script is DDP's usual one: ``DistributedSampler`` with ``set_epoch``, ``DistributedDataParallel`` around a
model with BatchNorm, SGD with momentum, ``no_sync()`` for gradient accumulation. With ``--backend torch`` it
imports torch's DDP and sampler and joins with ``init_process_group("gloo")`` (run it under torchrun); by
default it imports paratrain's and joins with ``paratrain.init()`` (run it under ``paratrain launch``): those
import lines are all that differ. The two end with the same parameters to the bit (the checksum printed last).
``--strategy`` picks any paratrain strategy on the same wrapper (``bsp`` and ``ssp:S`` need ``--servers 1``).
The data is scikit-learn's bundled digits (no download).

Run::

    torchrun --standalone --nproc-per-node 2 -m paratrain.examples.ddp_digits --backend torch
    paratrain launch -n 2 -- python -m paratrain.examples.ddp_digits
    paratrain launch -n 2 --servers 1 -- python -m paratrain.examples.ddp_digits --strategy ssp:1
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    """Trains on 80 % of digits, accumulating every other batch under ``no_sync()``; prints the test accuracy
    of each epoch and a checksum of the final parameters on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["paratrain", "torch"], default="paratrain", help="whose DDP")
    parser.add_argument("--strategy", default="allreduce", help="paratrain's strategy on the wrapper")
    parser.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    args = parser.parse_args()

    Wrapper: Any  # noqa: N806 (a class, imported from torch or paratrain)
    Sampler: Any  # noqa: N806
    if args.backend == "torch":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as Wrapper
        from torch.utils.data.distributed import DistributedSampler as Sampler

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        import paratrain as pt
        from paratrain.torch import DistributedDataParallel as Wrapper
        from paratrain.torch import DistributedSampler as Sampler

        pt.init()
        rank = pt.rank()

    from sklearn.datasets import load_digits

    torch.manual_seed(rank)  # different weights on every rank: the wrapper starts them all from rank 0's
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target)
    train, test = TensorDataset(x[:1440], y[:1440]), TensorDataset(x[1440:], y[1440:])
    sampler = Sampler(train, shuffle=True, seed=7)
    loader = DataLoader(train, batch_size=16, sampler=sampler)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    # paratrain's wrapper takes any paratrain strategy; DDP's rule (allreduce) is the default of both
    model = Wrapper(net) if args.strategy == "allreduce" else Wrapper(net, strategy=args.strategy, optimizer=opt)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        for step, (data, target) in enumerate(loader):
            if step % 2 == 0:  # accumulate this batch locally; the next backward reduces both
                with model.no_sync():
                    functional.cross_entropy(model(data), target).backward()  # type: ignore[no-untyped-call]
                continue
            functional.cross_entropy(model(data), target).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            accuracy = (model.module(test.tensors[0]).argmax(1) == test.tensors[1]).double().mean()
        if rank == 0:
            print(f"epoch {epoch}: test accuracy {100 * float(accuracy):.2f}%", flush=True)
    if rank == 0:
        flat = torch.cat([p.detach().flatten() for p in model.module.state_dict().values() if p.is_floating_point()])
        print(f"parameters sha256 {hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]}", flush=True)
    if args.backend == "torch":  # as torch asks before exit (Gloo's threads otherwise may abort the interpreter's)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
