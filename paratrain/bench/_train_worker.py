"""One process of ``paratrain bench train``: times training steps of the MLP or LeNet-5.

Modes: ``single`` (one process, no communication), ``concurrent`` (one of several such processes started
together, ``PARATRAIN_BENCH_RANK``/``PARATRAIN_BENCH_WORLD`` set by the benchmark: the same cores doing the same
arithmetic with no communication at all, the limit of data parallelism), ``paratrain`` (under ``paratrain
launch``, ``DistributedOptimizer(strategy="allreduce")``), ``ddp`` (``torch.nn.parallel.DistributedDataParallel``
over Gloo; ``RANK``/``WORLD_SIZE``/``MASTER_*`` set by the benchmark) and ``horovod`` (Horovod's
``DistributedOptimizer`` under ``horovodrun``, where Horovod is installed). Inputs are random 28x28 images with
random labels (a fixed seed): the speed of a step does not depend on the pixel values, and no dataset is needed.

``--device cuda`` trains on a GPU (rank r on GPU r modulo the GPUs there are: processes share one where there are
fewer GPUs than workers) and ``--ddp-backend`` picks DDP's process group (``gloo``, or ``nccl``, which needs a GPU
per rank). The parts below are then host times (kernels run asynchronously); the whole timed loop ends with a
device synchronisation, so samples/s is exact.

Each step is timed in three parts on the training thread: forward and backward (``compute_s``; with DDP and
Horovod this includes the communication they start from their hooks and, for DDP, wait for inside backward),
waiting for the gradients to arrive (``wait_s``: paratrain's and Horovod's ``synchronize()``), and the optimizer
update (``apply_s``). For paratrain, the shared-memory collectives' own accounting (copy in, reduce, copy out,
waiting for peers; :class:`~paratrain.collectives.shm.ShmGroup` ``phases``) comes with it.
Writes ``{mode}-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain._exit import exit_with


@dataclass
class _Engine:
    """What a mode trains with: the model (DDP's wrapper), the optimizer, this process's rank among ``world``,
    the barrier that starts the timed steps together and the wait for the gradients (None: none)."""

    model: Any
    optimizer: Any
    rank: int
    world: int
    barrier: Callable[[], object] | None = None
    sync: Callable[[], object] | None = None


def _launched_rank(mode: str) -> tuple[int, int]:
    """This process's rank and world as its launcher set them (before any engine starts; its GPU follows it)."""
    if mode == "concurrent":
        return int(os.environ["PARATRAIN_BENCH_RANK"]), int(os.environ["PARATRAIN_BENCH_WORLD"])
    if mode == "ddp":
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "paratrain":
        return int(os.environ.get("LOCAL_RANK", "0")), 1  # (its GPU; pt.init() gives the rank)
    return 0, 1


def _engine(args: argparse.Namespace, model: Any, device: Any) -> _Engine:
    """The mode's distributed training set up around ``model`` (on ``device``)."""
    import torch

    rank, world = _launched_rank(args.mode)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if args.mode == "concurrent":
        out = Path(args.out)
        return _Engine(model, optimizer, rank, world, barrier=lambda: _file_barrier(out, rank, world))
    if args.mode == "paratrain":
        import paratrain as pt
        import paratrain.torch as ptt

        ctx = pt.init()
        ptt.broadcast_parameters(model)
        optimizer = ptt.DistributedOptimizer(optimizer, model=model, strategy="allreduce")
        return _Engine(model, optimizer, ctx.rank, ctx.world_size, barrier=ctx.barrier, sync=optimizer.synchronize)
    if args.mode == "ddp":
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=120)
        dist.init_process_group(args.ddp_backend, rank=rank, world_size=world, timeout=timeout)
        ids = [device.index] if device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        return _Engine(ddp, optimizer, rank, world, barrier=dist.barrier)
    if args.mode == "horovod":
        hvd: Any = importlib.import_module("horovod.torch")  # optional: an anchor where it is installed
        hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        return _Engine(model, optimizer, hvd.rank(), hvd.size(), barrier=hvd.barrier, sync=optimizer.synchronize)
    return _Engine(model, optimizer, rank, world)  # single


def _timed(args: argparse.Namespace, engine: _Engine, device: Any) -> dict[str, Any]:
    """Warm-up steps, then the timed ones (started together where there is a barrier); their timing."""
    import torch
    from torch.nn import functional

    model, optimizer, sync = engine.model, engine.optimizer, engine.sync
    gen = torch.Generator().manual_seed(engine.rank)
    xs = torch.rand(8, args.batch_size, 1, 28, 28, generator=gen).to(device)
    ys = torch.randint(0, 10, (8, args.batch_size), generator=gen).to(device)
    settle: Any = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    parts = {"compute_s": 0.0, "wait_s": 0.0, "apply_s": 0.0}

    def step(i: int) -> None:
        t0 = time.perf_counter()
        optimizer.zero_grad()
        functional.cross_entropy(model(xs[i % 8]), ys[i % 8]).backward()  # type: ignore[no-untyped-call]
        t1 = time.perf_counter()
        if sync is not None:
            sync()
        t2 = time.perf_counter()
        if sync is not None and args.mode == "horovod":
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        t3 = time.perf_counter()
        parts["compute_s"] += t1 - t0
        parts["wait_s"] += t2 - t1
        parts["apply_s"] += t3 - t2

    for i in range(args.warmup):
        step(i)
    settle()
    if engine.barrier is not None:
        engine.barrier()
    phases0 = _shm_phases(args.mode)
    parts = dict.fromkeys(parts, 0.0)
    start = time.perf_counter()
    for i in range(args.steps):
        step(i)
    settle()  # the device's queued work belongs to the timed steps
    elapsed = time.perf_counter() - start
    phases = {k: v - phases0.get(k, 0.0) for k, v in _shm_phases(args.mode).items()}
    return {
        "mode": args.mode,
        "rank": engine.rank,
        "world_size": engine.world,
        "seconds": elapsed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "samples_per_sec": args.steps * args.batch_size / elapsed,
        "device": str(device),
        **parts,
        "shm_phases_s": phases,
    }


def _close(mode: str, optimizer: Any) -> None:
    """Ends the mode's engine (after the result is written)."""
    if mode == "paratrain":
        close = getattr(optimizer, "close", None)
        if callable(close):
            close()
        import paratrain as pt

        pt.shutdown()
    elif mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
        # torch 2.13's Gloo sometimes hangs the interpreter's exit after this (4 of 5 LeNet-5 rounds of one `bench
        # train`; Python's faulthandler shows the main thread in the exit and a Gloo thread with no Python frame),
        # and the bench then counted a finished, recorded run as failed. The result is written: leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    elif mode == "horovod":
        importlib.import_module("horovod.torch").shutdown()


def main(argv: list[str] | None = None) -> int:
    """Builds the model, runs warm-up then timed steps, writes the timing."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["single", "concurrent", "paratrain", "ddp", "horovod"], required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (rank r on GPU r mod the GPUs there are)")
    parser.add_argument("--ddp-backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args(argv)

    import torch

    from paratrain.train.models import build_model
    from paratrain.train.worker import worker_device

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    torch.manual_seed(0)
    model = build_model(args.model, side=28, classes=10)
    # processes share the GPUs there are, round robin (one each where there are enough)
    device = worker_device(args.device, _launched_rank(args.mode)[0])
    model.to(device)
    engine = _engine(args, model, device)
    result = _timed(args, engine, device)
    Path(args.out, f"{args.mode}-rank{engine.rank}.json").write_text(json.dumps(result))
    _close(args.mode, engine.optimizer)
    return 0


def _file_barrier(out: Path, rank: int, world: int, timeout: float = 120.0) -> None:
    """Starts the concurrent processes' timed steps together: each writes a marker and waits for all of them
    (polling every millisecond; these processes share nothing else, by design)."""
    (out / f"concurrent-ready{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all((out / f"concurrent-ready{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other concurrent processes did not start within {timeout:.0f} s")
        time.sleep(0.001)


def _shm_phases(mode: str) -> dict[str, float]:
    """The shared-memory collectives' accounting of this process so far (paratrain only; empty otherwise)."""
    if mode != "paratrain":
        return {}
    import paratrain as pt

    shm = pt.runtime.context.current().world.collectives._shm
    group = None if shm is None else shm.group
    return {} if group is None else dict(getattr(group, "phases", {}))


if __name__ == "__main__":
    exit_with(main)
