"""One process of ``paratrain bench pipeline``: trains one engine's stage (or the whole model) and times it.

Engines: ``single`` (the whole model in one process, the same micro-batch loop: every micro-batch's summed
loss back-propagated in turn, one optimizer step), ``paratrain`` (one stage of :class:`paratrain.torch.pipeline.Pipe`
under ``paratrain launch``, with ``trace=`` spans kept per step) and ``torch`` (one stage of
``torch.distributed.pipelining``: ``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B`` over Gloo,
``scale_grads=False``; ``RANK``/``WORLD_SIZE``/``MASTER_*`` set by the benchmark). Every process is single-threaded,
builds the same model from the same seed, and trains on the same synthetic mini-batches, so every engine's loss
of the first steps must equal one process's. Writes ``{engine}-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain._exit import exit_with
from paratrain.bench._timing import start_watchdog, write_result

__all__ = [
    "count_saved_bytes",
    "loss_fn",
    "make_batches",
    "model_layers",
    "one_process_step",
    "optimizer_for",
    "rss_bytes",
]

#: Steps whose summed loss every engine reports, to be compared with one process's.
CHECKED_STEPS = 2
#: Distinct synthetic mini-batches, cycled through (enough that no step reuses the previous one's data).
BATCHES = 4
#: Image models read 1x28x28 images of 10 classes (Fashion-MNIST's shape); the transformer reads windows of
#: ``paratrain.train.data.CONTEXT`` tokens of this vocabulary (printable ASCII's size, a chosen stand-in).
SIDE, CLASSES, VOCAB = 28, 10, 96


def is_text(name: str) -> bool:
    """Whether model ``name`` reads token windows (else images)."""
    from paratrain.train.models import MODEL_KINDS

    return MODEL_KINDS.get(name) == "text"


def model_layers(name: str) -> list[nn.Module]:
    """The ``paratrain train`` model ``name`` as a flat list of layers (nested ``nn.Sequential`` opened), built
    from seed 0: the units a pipeline may cut between. Every engine calls this, so all start from equal weights."""
    from paratrain.train.data import CONTEXT
    from paratrain.train.models import build_model

    torch.manual_seed(0)
    text = is_text(name)
    model = build_model(name, side=CONTEXT if text else SIDE, classes=VOCAB if text else CLASSES)

    def flat(module: nn.Module) -> list[nn.Module]:
        if isinstance(module, nn.Sequential):
            return [leaf for child in module for leaf in flat(child)]
        return [module]

    return flat(model)


def make_batches(model: str, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic mini-batches from a fixed seed: uniform 1x28x28 images and labels, or uniform token windows and
    next tokens. A step's speed does not depend on the values, and no dataset is read."""
    gen = torch.Generator().manual_seed(1)
    if is_text(model):
        from paratrain.train.data import CONTEXT

        windows = [torch.randint(0, VOCAB, (batch_size, CONTEXT + 1), generator=gen) for _ in range(BATCHES)]
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]
    return [
        (torch.rand(batch_size, 1, SIDE, SIDE, generator=gen), torch.randint(0, CLASSES, (batch_size,), generator=gen))
        for _ in range(BATCHES)
    ]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``paratrain train``'s cross-entropy, summed over the micro-batch: the micro-batches' gradients then add up
    to the mini-batch's (torch's ``scale_grads=False``)."""
    from paratrain.train.tasks import loss

    return loss(output, target, reduction="sum")


def optimizer_for(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The one optimizer every engine uses."""
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def one_process_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, microbatches: int
) -> float:
    """One step of the whole model in one process, micro-batch by micro-batch as the pipelines run it (each
    micro-batch's loss back-propagated in turn, then one optimizer step); returns the summed loss."""
    total = 0.0
    for xm, ym in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches), strict=True):
        loss = loss_fn(model(xm), ym)
        loss.backward()  # type: ignore[no-untyped-call]
        total += float(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from /proc/self/status (0, 0 where it does not exist)."""
    values = {"VmRSS:": 0, "VmHWM:": 0}
    try:
        with open("/proc/self/status", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if parts and parts[0] in values:
                    values[parts[0]] = int(parts[1]) * 1024
    except OSError:
        pass
    return values["VmRSS:"], values["VmHWM:"]


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux's ``clear_refs`` 5), so the peak measures training, not start-up."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def count_saved_bytes(module: nn.Module, inp: torch.Tensor, target: torch.Tensor) -> int:
    """Bytes one forward of ``module`` (plus the loss) keeps for its backward: the input and every tensor autograd
    saves, each storage once, the parameters not counted: the rule ``Pipe.peak_held_bytes`` counts by."""
    counted = {int(p.untyped_storage().data_ptr()) for p in module.parameters()}
    counted.add(int(inp.untyped_storage().data_ptr()))
    counted.add(int(target.untyped_storage().data_ptr()))
    saved = [inp.numel() * inp.element_size()]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        where = int(tensor.untyped_storage().data_ptr())
        if where not in counted:
            counted.add(where)
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(module(inp), target)
    loss.backward()  # type: ignore[no-untyped-call]
    module.zero_grad(set_to_none=True)
    return sum(saved)


def main(argv: list[str] | None = None) -> int:
    """Trains, times, writes this rank's result (or why it failed); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["single", "paratrain", "torch"], required=True)
    parser.add_argument("--label", required=True, help="the result file's engine name")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--model", required=True)
    parser.add_argument("--balance", required=True, help="layers per stage, comma-separated")
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=300.0)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, f"pipeline bench worker ({args.label})")
    torch.set_num_threads(1)
    rank = 0
    payload: dict[str, Any] = {}
    try:
        run = {"single": _single, "paratrain": _paratrain, "torch": _torch}[args.engine]
        rank = run(args, payload)
        payload["status"] = "ok"
        code = 0
    except Exception as exc:
        payload.update({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        print(f"{args.label}: failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
        rank = int(os.environ.get("RANK", rank))
    write_result(args.out, args.label, rank, payload)
    return code


def _balance(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.balance.split(",")]


def _timed(
    args: argparse.Namespace,
    payload: dict[str, Any],
    step: Callable[[torch.Tensor, torch.Tensor], float | None],
    barrier: Callable[[], None],
    on_step: Callable[[float, float], None] | None = None,
) -> None:
    """The loop every engine runs: warm-up steps (the first ones' losses kept for the check), a barrier, the
    timed steps back to back; the peak RSS is reset after the warm-up's first step (allocations settled)."""
    batches = make_batches(args.model, args.batch_size)
    losses: list[float] = []
    for i in range(args.warmup):
        loss = step(*batches[i % BATCHES])
        if loss is not None and i < CHECKED_STEPS:
            losses.append(loss)
    barrier()
    base, _ = rss_bytes()
    payload["peak_reset"] = reset_peak_rss()
    walls, start = [], time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.time()
        step(*batches[i % BATCHES])
        t1 = time.time()
        walls.append(t1 - t0)
        if on_step is not None:
            on_step(t0, t1)
    payload["seconds"] = time.perf_counter() - start
    _, peak = rss_bytes()
    payload.update({"losses": losses, "step_walls": walls, "rss_base_bytes": base, "rss_peak_bytes": peak})
    payload.update({"steps": args.steps, "batch_size": args.batch_size})


def _single(args: argparse.Namespace, payload: dict[str, Any]) -> int:
    model = nn.Sequential(*model_layers(args.model))
    opt = optimizer_for(list(model.parameters()))
    m = args.microbatches

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        return one_process_step(model, opt, x, y, m)

    _timed(args, payload, step, lambda: None)
    x, y = make_batches(args.model, args.batch_size)[0]
    payload["held_bytes"] = count_saved_bytes(model, torch.tensor_split(x, m)[0], torch.tensor_split(y, m)[0])
    payload["stage"] = 0
    return 0


def _paratrain(args: argparse.Namespace, payload: dict[str, Any]) -> int:
    import paratrain as pt
    from paratrain.torch.pipeline import Pipe

    ctx = pt.init()
    spans: list[tuple[str, str, float, float]] = []
    steps: list[list[tuple[str, str, float, float]]] = []

    def trace(name: str, category: str, start: float, end: float) -> None:
        spans.append((name, category, start, end))

    # the timed pipe and the checkpointing probe below differ only in trace= and checkpoint=
    make = functools.partial(
        Pipe,
        balance=_balance(args),
        microbatches=args.microbatches,
        schedule=args.schedule,
        optimizer=optimizer_for,
        loss_fn=loss_fn,
        context=ctx,
    )
    pipe = make(model_layers(args.model), trace=trace)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        spans.clear()
        return pipe.step(x if pipe.is_first else None, y if pipe.is_last else None)

    def keep(start: float, end: float) -> None:
        steps.append([*spans, ("step", "step", start, end)])

    _timed(args, payload, step, ctx.barrier, keep)
    payload["held_bytes"] = pipe.peak_held_bytes
    payload["spans"] = steps
    payload["stage"] = ctx.rank
    # re-materialisation's memory: one more step of a checkpointing pipe on a fresh copy (not timed)
    probe = make(model_layers(args.model), checkpoint=True)
    x, y = make_batches(args.model, args.batch_size)[0]
    probe.step(x if probe.is_first else None, y if probe.is_last else None)
    payload["held_bytes_checkpoint"] = probe.peak_held_bytes
    ctx.barrier()
    pt.shutdown()
    return ctx.rank


def _torch(args: argparse.Namespace, payload: dict[str, Any]) -> int:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=max(args.deadline, 1.0))
    )
    balance = _balance(args)
    first = sum(balance[:rank])
    module = nn.Sequential(*model_layers(args.model)[first : first + balance[rank]])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    sched = kind(stage, args.microbatches, loss_fn=loss_fn, scale_grads=False)
    opt = optimizer_for(list(module.parameters()))
    last = rank == world - 1

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sum(float(loss.detach()) for loss in losses) if last else None

    _timed(args, payload, step, dist.barrier)
    payload["stage"] = rank
    dist.barrier()
    dist.destroy_process_group()
    return rank


if __name__ == "__main__":
    exit_with(main)
