"""A pipeline with stages on different devices (the CPU and the GPU, or both on the GPU): the same losses and
parameters as the all-CPU pipeline. Skipped without a CUDA device (benchmarks/gpu/run.sh)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from paratrain import Context  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402
from paratrain.torch.pipeline import Pipe  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def train(devices: list[str], schedule: str, p2p: str = "auto") -> list[tuple[list[float], dict[str, Any]]]:
    gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(3, 12, 8, generator=gen), torch.randn(3, 12, 2, generator=gen)

    def stage(ctx: Context) -> tuple[list[float], dict[str, Any]]:
        layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)]
        init = torch.Generator().manual_seed(0)  # (the global seed is shared by the thread ranks)
        with torch.no_grad():
            for p in nn.Sequential(*layers).parameters():
                p.copy_(torch.randn(p.shape, generator=init) * 0.3)
        pipe = Pipe(
            layers,
            balance=[2, 3],
            microbatches=4,
            schedule=schedule,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            device=devices,
            p2p=p2p,
        )
        assert pipe.device == torch.device(devices[ctx.rank])
        # a stage on the CPU, or stages sharing a GPU: activations go through host memory; a GPU each: NCCL
        host = "cpu" in devices or len(set(devices)) < len(devices)
        assert (pipe.links is None) == host
        losses = [pipe.step(xs[k], ys[k]) for k in range(3)]
        return [loss for loss in losses if loss is not None], {
            n: p.detach().cpu() for n, p in pipe.module.named_parameters()
        }

    return run_ranks(2, stage, timeout=60)


def one_process(device: str) -> tuple[list[float], dict[str, Any]]:
    """The same layers, data and micro-batches in one process, no pipeline: each micro-batch's loss backpropagated,
    one optimizer step per mini-batch (what the pipeline computes; on the CPU they agree bit for bit)."""
    gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(3, 12, 8, generator=gen), torch.randn(3, 12, 2, generator=gen)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)]
    init = torch.Generator().manual_seed(0)
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    model.to(device)
    opt, loss_fn = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), nn.MSELoss(reduction="sum")
    losses = []
    for k in range(3):
        total = 0.0
        for xm, ym in zip(torch.tensor_split(xs[k], 4), torch.tensor_split(ys[k], 4), strict=True):
            loss = loss_fn(model(xm.to(device)), ym.to(device))
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        opt.step()
        opt.zero_grad()
    # named as the stages name them: stage 0 holds layers 0-1, stage 1 layers 2-4 renumbered from 0
    params = {name: p.detach().cpu() for name, p in model.named_parameters()}
    return losses, params


def _largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in b)


@pytest.mark.parametrize("devices", [["cpu", "cuda"], ["cuda", "cpu"], ["cuda", "cuda"]], ids="-".join)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_on_the_gpu_train_as_on_the_cpu(devices: list[str], schedule: str) -> None:
    """A stage on the GPU computes what its layers compute on the GPU in one process, and differs from the CPU
    pipeline by no more than GPU kernels differ from CPU ones.

    Why not the CPU pipeline's values to 1e-5 (as before): GPU stages differed from the all-CPU pipeline by up to
    6.4e-5 after three steps (an H200), 1.8e-4 to 3.4e-4 on an H100, and so do the same layers in one process, GPU
    against CPU: 1.8e-4 (benchmarks/gpu/runs-2026-11-28-h100/rounding.json: TF32 off, cuBLAS adds in other orders
    and the sum-of-squares loss with momentum amplifies the last bits; in float64 the same gaps are 1e-12, and the
    all-GPU pipeline equals the one-process GPU run bit for bit in both dtypes). So the bound is measured here from
    the one-process runs: a stage may part from the CPU by at most four times what the GPU's kernels part by (the
    H100's worst mixed pipeline: 1.8 times), and the all-GPU pipeline must equal the one-process GPU run to the
    rounding of one step (1e-6 relative; it was exact)."""
    gpu_losses, gpu_params = one_process("cuda")
    _, cpu_params = one_process("cpu")
    kernels = _largest_difference(gpu_params, cpu_params)
    stages = train(devices, schedule)
    for (losses, params), (cpu_losses, cpu_ref) in zip(stages, train(["cpu", "cpu"], schedule), strict=True):
        assert losses == pytest.approx(cpu_losses, rel=1e-4)
        assert _largest_difference(params, cpu_ref) <= 4 * kernels + 1e-6, (kernels, devices)
        if devices == ["cuda", "cuda"] and losses:
            assert losses == pytest.approx(gpu_losses, rel=1e-6)
    if devices == ["cuda", "cuda"]:
        merged = dict(stages[0][1])
        merged.update({f"{int(n.split('.')[0]) + 2}.{n.split('.')[1]}": p for n, p in stages[1][1].items()})
        for name, value in gpu_params.items():
            torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL's device-to-device sends need a GPU per stage")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p2p", ["auto", "nccl"])
def test_stages_on_two_gpus_send_device_to_device_through_nccl(schedule: str, p2p: str) -> None:
    for (losses, params), (cpu_losses, cpu_params) in zip(
        train(["cuda:0", "cuda:1"], schedule, p2p), train(["cpu", "cpu"], schedule), strict=True
    ):
        assert losses == pytest.approx(cpu_losses, rel=1e-5)
        for name, value in cpu_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
