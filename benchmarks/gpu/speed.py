"""paratrain against DDP on a GPU machine, side by side in one command (issue 42, item 4).

Two measurements, each repeated in interleaved rounds (the order of the engines rotates every round) and
reported as the median with the spread:

``shared``: two ranks (processes, under ``paratrain launch``) train LeNet-5 and the MLP on 28x28 inputs, batch 64
per rank, SGD with momentum. Rank r trains on GPU r modulo the GPUs there are, so on a one-GPU machine both ranks
share it: paratrain's allreduce then stages the gradients through pinned host memory, and DDP runs over Gloo
with CUDA tensors; where every rank has a GPU of its own, both go through NCCL. ``alone`` is the same two
processes training with no communication at all (the limit). Both engines run in the same two processes, one
after the other, so they share everything but the engine.

``one``: one rank on its own GPU, as each rank of a multi-GPU job runs: a 134 M-parameter MLP (eight 4096x4096
linear layers with ReLU), batch 256, SGD with momentum. ``plain`` is torch alone; ``paratrain`` is the
DistributedOptimizer with ``always_communicate=True`` (the buckets, the hooks and the NCCL engine's calls all
run, over one rank); ``paratrain_local`` is its default at world size 1 (nothing sent); ``ddp_nccl`` is DDP over
NCCL at world size 1. Each engine's parameters after the timed steps are compared with ``plain``'s (they must be
equal: a mean over one rank is the gradient itself).

With ``--profile``, rank 0 records torch's profiler for a few steps of each engine after the rounds and writes
the Chrome traces plus, per trace, the share of the wall time the GPU was busy (``gpu_busy_share``).

    python benchmarks/gpu/speed.py OUT [--rounds 3] [--profile]

Writes OUT/speed.json (and OUT/traces/*.json with ``--profile``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHARED_MODELS = ("lenet", "mlp")
SHARED_ENGINES = ("paratrain", "ddp", "alone")
ONE_ENGINES = ("plain", "paratrain", "paratrain_local", "ddp_nccl")
BATCH, WIDTH, LAYERS, BIG_BATCH = 64, 4096, 8, 256


def gpu_busy_share(trace_path: Path) -> dict[str, float]:
    """From a Chrome trace of torch's profiler: the wall time between the first and the last GPU activity, and the
    share of it during which a kernel, copy or memset ran (the union of their intervals)."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not spans:
        return {"gpu_wall_us": 0.0, "gpu_busy_us": 0.0, "gpu_busy_share": 0.0}
    busy, end = 0.0, spans[0][0]
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    wall = max(b for _, b in spans) - spans[0][0]
    return {"gpu_wall_us": wall, "gpu_busy_us": busy, "gpu_busy_share": busy / wall if wall else 0.0}


def _profiled(run: Any, path: Path) -> dict[str, float]:
    """Runs ``run()`` under torch's profiler (CPU and CUDA) and writes its trace to ``path``."""
    import torch

    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return gpu_busy_share(path)


# -- shared: two ranks, paratrain against DDP -----------------------------------------------------------------


def shared_worker(args: argparse.Namespace) -> None:
    """One rank of the ``shared`` measurement (under ``paratrain launch``)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn import functional

    import paratrain as pt
    import paratrain.torch as ptt
    from paratrain.train.models import build_model

    ctx = pt.init()
    rank, world = ctx.rank, ctx.world_size
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    device = torch.device("cuda", rank % gpus) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    backend = "nccl" if gpus >= world else "gloo"
    settle = torch.cuda.synchronize if gpus else (lambda: None)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    gen = torch.Generator().manual_seed(rank)
    xs = torch.rand(8, BATCH, 1, 28, 28, generator=gen).to(device)
    ys = torch.randint(0, 10, (8, BATCH), generator=gen).to(device)

    def build(engine: str, name: str) -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = build_model(name, side=28, classes=10).to(device)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if engine == "paratrain":
            opt = ptt.DistributedOptimizer(opt, model=model, strategy="allreduce", context=ctx)
        elif engine == "ddp":
            ids = [device.index] if gpus else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, opt, ctx.barrier

    def steps(model: Any, opt: Any, n: int) -> None:
        for i in range(n):
            opt.zero_grad()
            functional.cross_entropy(model(xs[i % 8]), ys[i % 8]).backward()
            opt.step()

    def measure(engine: str, name: str) -> float:
        model, opt, barrier = build(engine, name)
        steps(model, opt, args.warmup)
        settle()
        barrier()
        start = time.perf_counter()
        steps(model, opt, args.steps)
        settle()
        seconds = time.perf_counter() - start
        if engine == "paratrain":
            opt.close()
        return seconds

    rows = []
    for round_ in range(args.rounds):
        for name in SHARED_MODELS:
            shift = round_ % len(SHARED_ENGINES)
            for engine in SHARED_ENGINES[shift:] + SHARED_ENGINES[:shift]:
                seconds = measure(engine, name)
                slowest = float(ctx.allgather(np.array([seconds])).max())
                rows.append(
                    {
                        "round": round_,
                        "model": name,
                        "engine": engine,
                        "seconds": slowest,
                        "samples_per_sec": world * args.steps * BATCH / slowest,
                    }
                )
                if rank == 0:
                    print(
                        f"shared round {round_} {name:<6} {engine:<10} {rows[-1]['samples_per_sec']:10,.0f} samples/s",
                        flush=True,
                    )
    profiles = {}
    if args.profile:
        for engine in ("paratrain", "ddp"):
            model, opt, barrier = build(engine, "lenet")
            steps(model, opt, args.warmup)
            settle()
            barrier()
            path = Path(args.out, "traces", f"shared-lenet-{engine}-rank{rank}.json")
            if rank == 0:
                profiles[engine] = _profiled(lambda m=model, o=opt: steps(m, o, 20), path)
            else:
                steps(model, opt, 20)
                settle()
            barrier()
            if engine == "paratrain":
                opt.close()
    if rank == 0:
        result = {"backend": backend, "gpus": gpus, "world_size": world, "rows": rows, "profiles": profiles}
        Path(args.out, "speed-shared.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    pt.shutdown()


# -- one: one rank on its own GPU -------------------------------------------------------------------------------


def one_worker(args: argparse.Namespace) -> None:
    """The ``one`` measurement, in this process (paratrain at world size 1, DDP over NCCL at world size 1)."""
    import torch
    import torch.distributed as dist

    import paratrain as pt
    import paratrain.torch as ptt

    ctx = pt.init()
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    settle = torch.cuda.synchronize if cuda else (lambda: None)
    store = tempfile.mkdtemp(prefix="paratrain-speed-")  # kept: NCCL reads the store at its first collective
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    width = args.width
    torch.manual_seed(0)

    def mlp() -> torch.nn.Sequential:
        layers: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers).to(device)

    template = mlp()
    x = torch.randn(BIG_BATCH, width, device=device)
    y = torch.randn(BIG_BATCH, width, device=device)

    def build(engine: str) -> tuple[Any, Any]:
        model = mlp()
        model.load_state_dict(template.state_dict())
        opt: Any = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if engine in ("paratrain", "paratrain_local"):
            opt = ptt.DistributedOptimizer(opt, model=model, context=ctx, always_communicate=engine == "paratrain")
        elif engine == "ddp_nccl":
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        return model, opt

    def steps(model: Any, opt: Any, n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()

    def params_of(model: Any) -> list[Any]:
        inner = model.module if hasattr(model, "module") else model
        return [p.detach() for p in inner.parameters()]

    rows, reference = [], None
    for round_ in range(args.rounds):
        shift = round_ % len(ONE_ENGINES)
        for engine in ONE_ENGINES[shift:] + ONE_ENGINES[:shift]:
            model, opt = build(engine)
            steps(model, opt, args.warmup)
            settle()
            start = time.perf_counter()
            steps(model, opt, args.big_steps)
            settle()
            seconds = time.perf_counter() - start
            final = [p.clone() for p in params_of(model)]
            if round_ == 0 and engine == "plain":
                reference = final
            row = {"round": round_, "engine": engine, "ms_per_step": 1e3 * seconds / args.big_steps}
            if round_ == 0:
                row["params_equal_plain"] = None  # filled below once plain's are known
                row["_final"] = final
            rows.append(row)
            print(f"one round {round_} {engine:<16} {row['ms_per_step']:8.3f} ms/step", flush=True)
            if hasattr(opt, "close"):
                opt.close()
            del model, opt
            if cuda:
                torch.cuda.empty_cache()
    for row in rows:
        final = row.pop("_final", None)
        if final is not None and reference is not None:
            row["params_equal_plain"] = all(torch.equal(a, b) for a, b in zip(final, reference, strict=True))
    profiles = {}
    if args.profile:
        for engine in ("plain", "paratrain", "ddp_nccl"):
            model, opt = build(engine)
            steps(model, opt, args.warmup)
            settle()
            path = Path(args.out, "traces", f"one-{engine}.json")
            profiles[engine] = _profiled(lambda m=model, o=opt: steps(m, o, 10), path)
            if hasattr(opt, "close"):
                opt.close()
            del model, opt
    result = {
        "params": sum(p.numel() for p in template.parameters()),
        "batch": BIG_BATCH,
        "rows": rows,
        "profiles": profiles,
    }
    Path(args.out, "speed-one.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    pt.shutdown()


# -- the driver ---------------------------------------------------------------------------------------------------


def _summary(rows: list[dict[str, Any]], key: str, group: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        name = "/".join(str(row[g]) for g in group)
        out.setdefault(name, []).append(row[key])
    return {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for name, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    """Runs both measurements (each in its own processes) and writes OUT/speed.json."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="timed steps of the shared measurement")
    parser.add_argument("--big-steps", type=int, default=50, help="timed steps of the one-rank measurement")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--parts", default="shared,one")
    parser.add_argument("--profile", action="store_true", help="also record profiler traces (rank 0)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only checks the script itself")
    parser.add_argument("--width", type=int, default=WIDTH, help="width of the one-rank MLP's layers")
    parser.add_argument("--worker", choices=["shared", "one"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "shared":
        shared_worker(args)
        return 0
    if args.worker == "one":
        one_worker(args)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/speed.py needs a CUDA device (--device cpu only checks the script)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--big-steps",
        str(args.big_steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
        "--width",
        str(args.width),
    ] + (["--profile"] if args.profile else [])
    cuda = args.device == "cuda"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "width": args.width,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    status = 0
    parts = args.parts.split(",")
    if "shared" in parts:
        cmd = [
            sys.executable,
            "-m",
            "paratrain.cli.main",
            "launch",
            "-n",
            "2",
            "--",
            sys.executable,
            str(Path(__file__).resolve()),
            str(out),
            "--worker",
            "shared",
            *common,
        ]
        done = subprocess.run(cmd, check=False, timeout=600)
        if done.returncode == 0:
            shared = json.loads((out / "speed-shared.json").read_text())
            rates = _summary(shared["rows"], "samples_per_sec", ("model", "engine"))
            ratios = {m: rates[f"{m}/paratrain"]["median"] / rates[f"{m}/ddp"]["median"] for m in SHARED_MODELS}
            report["shared"] = {
                **shared,
                "samples_per_sec": rates,
                "paratrain_vs_ddp": ratios,
                "efficiency": {
                    f"{m}/{e}": rates[f"{m}/{e}"]["median"] / rates[f"{m}/alone"]["median"]
                    for m in SHARED_MODELS
                    for e in ("paratrain", "ddp")
                },
            }
            (out / "speed-shared.json").unlink()
        else:
            report["shared"] = {"failed": done.returncode}
            status = 1
    if "one" in parts:
        env = dict(os.environ, PARATRAIN_WORLD_SIZE="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--worker", "one", *common]
        done = subprocess.run(cmd, check=False, timeout=600, env=env)
        if done.returncode == 0:
            one = json.loads((out / "speed-one.json").read_text())
            times = _summary(one["rows"], "ms_per_step", ("engine",))
            plain = times["plain"]["median"]
            report["one"] = {
                **one,
                "ms_per_step": times,
                "vs_plain": {e: t["median"] / plain for e, t in times.items()},
            }
            (out / "speed-one.json").unlink()
        else:
            report["one"] = {"failed": done.returncode}
            status = 1
    (out / "speed.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("shared", "one")}))
    if "shared" in report and "paratrain_vs_ddp" in report["shared"]:
        print("shared paratrain/ddp:", json.dumps(report["shared"]["paratrain_vs_ddp"]))
        print("shared efficiency:", json.dumps(report["shared"]["efficiency"]))
    if "one" in report and "vs_plain" in report["one"]:
        print("one vs plain:", json.dumps(report["one"]["vs_plain"]))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
