"""The PyTorch front end: ``DistributedOptimizer``, ``broadcast_parameters`` and ``shard``.

Importing this package imports torch (the communication core does not). ``import paratrain as pt`` is enough:
the first use of ``pt.torch`` imports it.

Example:
    A data-parallel training script, run with ``paratrain launch -n 2 -- python train.py``::

        import torch, paratrain as pt

        pt.init()
        model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        pt.torch.broadcast_parameters(model)          # every worker starts from rank 0's weights
        opt = pt.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        loader = torch.utils.data.DataLoader(pt.torch.shard(train_set), batch_size=64)
        for epoch in range(10):
            loader.dataset.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        opt.close()
"""

from __future__ import annotations

from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES, Bucket, ParamInfo, plan_buckets
from paratrain.torch.broadcast import broadcast_parameters
from paratrain.torch.data import Shard, ShardSampler, shard, shard_indices
from paratrain.torch.ddp import DistributedDataParallel, DistributedSampler
from paratrain.torch.optimizer import DistributedOptimizer
from paratrain.torch.strategies import STRATEGIES, StrategySpec, parse_strategy

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "STRATEGIES",
    "Bucket",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DistributedSampler",
    "ParamInfo",
    "Shard",
    "ShardSampler",
    "StrategySpec",
    "broadcast_parameters",
    "parse_strategy",
    "plan_buckets",
    "shard",
    "shard_indices",
]
