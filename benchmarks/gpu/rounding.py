"""Where a pipeline stage on the GPU parts from the CPU: the pipeline, or the GPU's kernels? (issue 42, item 2)

The two-stage pipeline of ``tests/cuda/test_cuda_pipeline.py`` (8-16-16-2 with Tanh and ReLU, four micro-batches,
SGD with momentum, three steps, summed squared error) trained five ways: the pipeline on CPU/CPU, CPU/GPU,
GPU/CPU and GPU/GPU, and the same layers in one process with the same micro-batches (no pipeline) on the CPU and on
the GPU. If the pipeline computes what one process computes, each pipeline agrees with the one-process run on the
same devices far more tightly than the GPU run agrees with the CPU run; the GPU-versus-CPU difference of one
process is then the kernels' rounding (other reduction orders in cuBLAS, TF32 where enabled), the bound to hold a
GPU pipeline to against the CPU one. In float64 the same comparison must shrink by about nine orders of magnitude
(rounding scales with the unit roundoff; a real difference would not).

    python benchmarks/gpu/rounding.py OUT [--gpu cpu]   (cpu for the GPU: checks the script, every difference 0)

Writes OUT/rounding.json: the largest absolute and relative parameter differences of every pair, per dtype and
schedule, and the TF32 settings in force.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain import Context
from paratrain.testing import run_ranks
from paratrain.torch.pipeline import Pipe

STEPS, MICRO = 3, 4


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(STEPS, 12, 8, generator=gen), torch.randn(STEPS, 12, 2, generator=gen)
    return xs.to(dtype), ys.to(dtype)


def _layers(dtype: torch.dtype) -> list[nn.Module]:
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)]
    init = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in nn.Sequential(*layers).parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    return [layer.to(dtype) for layer in layers]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def one_process(device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same layers in one process: each micro-batch's summed loss backpropagated, one step per mini-batch."""
    xs, ys = _data(dtype)
    model = nn.Sequential(*_layers(dtype)).to(device)
    opt, loss_fn = _optimizer(model.parameters()), nn.MSELoss(reduction="sum")
    for k in range(STEPS):
        for xm, ym in zip(torch.tensor_split(xs[k], MICRO), torch.tensor_split(ys[k], MICRO), strict=True):
            loss_fn(model(xm.to(device)), ym.to(device)).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def pipeline(devices: list[str], schedule: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The pipeline of the CUDA test, stage 0 on ``devices[0]`` and stage 1 on ``devices[1]``."""
    xs, ys = _data(dtype)

    def stage(ctx: Context) -> dict[str, torch.Tensor]:
        pipe = Pipe(
            _layers(dtype),
            balance=[2, 3],
            microbatches=MICRO,
            schedule=schedule,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            device=devices,
        )
        for k in range(STEPS):
            pipe.step(xs[k], ys[k])
        offset = 0 if ctx.rank == 0 else 2  # the stage's layers are numbered from 0 in its own module
        return {
            f"{int(name.split('.')[0]) + offset}.{name.split('.')[1]}": p.detach().cpu()
            for name, p in pipe.module.named_parameters()
        }

    merged: dict[str, torch.Tensor] = {}
    for part in run_ranks(2, stage, timeout=120):
        merged.update(part)
    return merged


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest absolute difference over every parameter, and the largest relative one (to ``b``)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    absolute = max(float((a[n] - b[n]).abs().max()) for n in b)
    relative = max(float(((a[n] - b[n]).abs() / b[n].abs().clamp_min(1e-30)).max()) for n in b)
    return {"max_abs": absolute, "max_rel": relative}


def main(out: Path, gpu: str = "cuda") -> None:
    if gpu == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/rounding.py needs a CUDA device")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if gpu == "cuda" else gpu,
        "torch": torch.__version__,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "runs": {},
    }
    for dtype in (torch.float32, torch.float64):
        cpu, on_gpu = one_process("cpu", dtype), one_process(gpu, dtype)
        entry: dict[str, Any] = {"one_process_gpu_vs_cpu": difference(on_gpu, cpu)}
        for schedule in ("gpipe", "1f1b"):
            pipes = {
                "-".join(roles): pipeline([gpu if r == "gpu" else "cpu" for r in roles], schedule, dtype)
                for roles in (("cpu", "cpu"), ("cpu", "gpu"), ("gpu", "cpu"), ("gpu", "gpu"))
            }
            entry[schedule] = {
                **{f"pipeline_{k}_vs_cpu_one_process": difference(v, cpu) for k, v in pipes.items()},
                "pipeline_gpu-gpu_vs_gpu_one_process": difference(pipes["gpu-gpu"], on_gpu),
                **{f"pipeline_{k}_vs_cpu_pipeline": difference(v, pipes["cpu-cpu"]) for k, v in pipes.items()},
            }
        report["runs"][str(dtype).removeprefix("torch.")] = entry
    (out / "rounding.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]) if args else Path("gpu-rounding"), args[2] if len(args) > 2 and args[1] == "--gpu" else "cuda")
