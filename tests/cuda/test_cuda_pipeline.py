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


@pytest.mark.parametrize("devices", [["cpu", "cuda"], ["cuda", "cpu"], ["cuda", "cuda"]], ids="-".join)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_on_the_gpu_train_as_on_the_cpu(devices: list[str], schedule: str) -> None:
    for (losses, params), (cpu_losses, cpu_params) in zip(
        train(devices, schedule), train(["cpu", "cpu"], schedule), strict=True
    ):
        assert losses == pytest.approx(cpu_losses, rel=1e-5)
        for name, value in cpu_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)


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
