"""One process of ``paratrain bench soap``: trains one engine's tensor-parallel part of a model and times its steps.

Engines: ``single`` (the whole model in one process), ``paratrain`` (:func:`paratrain.torch.soap.parallelize`
under ``paratrain launch``) and ``torch`` (``torch.distributed.tensor.parallel.parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel`` on a CPU device mesh over Gloo; ``RANK``/``WORLD_SIZE``/``MASTER_*`` set by
the benchmark). Both split the same layers the same way (Megatron's pairs: every first Linear of a pair by its
output features, the second by its input features, the output all-reduced), build the model from seed 0 and
train on the same synthetic mini-batches, so the first steps' losses must equal one process's. Each step is
forward, backward and an SGD step with momentum; every rank records its step times, its first losses and the
bytes of the parameters it holds (read from its tensors: a DTensor's local shard). Writes
``{label}-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from paratrain._exit import exit_with
from paratrain.bench._timing import start_watchdog, write_result

__all__ = ["CHECKED_STEPS", "megatron_pairs", "one_process_losses"]

#: Steps whose loss every engine reports, to be compared with one process's.
CHECKED_STEPS = 2
SIDE, CLASSES, BATCHES = 28, 10, 4


def build(model: str) -> nn.Sequential:
    """``paratrain train``'s model ``model`` on 1x28x28 images of 10 classes, from seed 0."""
    from paratrain.train.models import build_model

    torch.manual_seed(0)
    built: nn.Sequential = build_model(model, side=SIDE, classes=CLASSES)
    return built


def megatron_pairs(model: nn.Sequential, tensor: int) -> dict[str, str]:
    """Megatron-LM's pairs (:func:`paratrain.soap.megatron_splits`) over the chain's Linear layers only: what
    torch's ``ColwiseParallel``/``RowwiseParallel`` split."""
    from paratrain.soap import LayerShape, megatron_splits

    return megatron_splits(
        [(n, LayerShape(m.in_features, m.out_features) if isinstance(m, nn.Linear) else None)
         for n, m in model.named_children()],
        tensor,
    )  # fmt: skip


def batches(batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic mini-batches from a fixed seed (a step's speed does not depend on the values)."""
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.rand(batch_size, 1, SIDE, SIDE, generator=gen), torch.randint(0, CLASSES, (batch_size,), generator=gen))
        for _ in range(BATCHES)
    ]


def one_process_losses(model: str, batch_size: int) -> list[float]:
    """The first :data:`CHECKED_STEPS` losses of the whole model trained in one process."""
    net = build(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, foreach=False)
    data, losses = batches(batch_size), []
    for step in range(CHECKED_STEPS):
        x, y = data[step % BATCHES]
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss))
    return losses


def _local_bytes(net: nn.Module) -> int:
    """Bytes of the parameters this process holds (a DTensor's local shard only)."""
    total = 0
    for p in net.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _paratrain(model: str, tensor: int) -> tuple[nn.Module, int, int]:
    import paratrain as pt
    from paratrain.soap import Mesh
    from paratrain.torch.soap import parallelize

    ctx = pt.init()
    net = build(model)
    return parallelize(net, megatron_pairs(net, tensor), ctx, Mesh.for_workers(ctx.world_size, tensor)), ctx.rank, 0


def _torch(model: str, tensor: int) -> tuple[nn.Module, int, int]:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = build(model)
    kinds = {"column": ColwiseParallel, "row": RowwiseParallel}
    plan = {name: kinds[split]() for name, split in megatron_pairs(net, tensor).items()}
    return parallelize_module(net, mesh, plan), dist.get_rank(), 1


def main() -> None:
    """Trains and times this rank's part; writes its result file."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=("single", "paratrain", "torch"), required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tensor", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=300.0)
    args = parser.parse_args()
    start_watchdog(args.deadline, f"bench soap {args.label}")
    torch.set_num_threads(1)
    net: nn.Module
    if args.engine == "single":
        net, rank, gloo = build(args.model), 0, 0
    else:
        net, rank, gloo = (_paratrain if args.engine == "paratrain" else _torch)(args.model, args.tensor)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, foreach=False)
    data, losses, times = batches(args.batch_size), [], []
    for step in range(args.warmup + args.steps):
        x, y = data[step % BATCHES]
        started = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
        if step < CHECKED_STEPS:
            losses.append(float(loss.detach()))
    payload: dict[str, Any] = {"status": "ok", "times": times, "losses": losses, "parameter_bytes": _local_bytes(net)}
    write_result(args.out, args.label, rank, payload)
    if gloo:
        import torch.distributed as dist

        dist.destroy_process_group()
    else:
        import paratrain as pt

        pt.shutdown()


if __name__ == "__main__":
    exit_with(main)
