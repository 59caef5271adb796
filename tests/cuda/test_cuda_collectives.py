"""CUDA tensors through the collectives and the DistributedOptimizer: results on the caller's device and dtype,
equal to the CPU run. Skipped without a CUDA device (CI has none); `benchmarks/gpu/run.sh` runs them on a GPU
machine. Two thread ranks share the one GPU here: the staged path (pinned host copies), not NCCL."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def _data(rank: int, dtype: Any) -> Any:
    return (torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1) - 7).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_collectives_of_cuda_tensors_equal_the_cpu_ones_and_stay_on_the_device(dtype: Any) -> None:
    def worker(ctx: Context) -> list[tuple[Any, Any]]:
        x = _data(ctx.rank, dtype)
        pairs = [(ctx.allreduce(x.cuda()), ctx.allreduce(x))]
        inplace = x.cuda()
        assert ctx.allreduce_(inplace) is inplace
        pairs.append((inplace, ctx.allreduce(x)))
        strided = x.cuda().t()  # not contiguous: reduced through a copy, written back into the view
        ctx.allreduce_(strided)
        pairs.append((strided, ctx.allreduce(x).t()))
        pairs.append((ctx.allreduce_async(x.cuda(), op="max").wait(), ctx.allreduce(x, op="max")))
        pairs.append((ctx.broadcast(x.cuda(), root=1), ctx.broadcast(x, root=1)))
        pairs.append((ctx.allgather(x.cuda()), ctx.allgather(x)))
        pairs.append((ctx.reduce_scatter(x.cuda()), ctx.reduce_scatter(x)))
        return pairs

    for pairs in run_ranks(2, worker, timeout=60):
        for on_gpu, on_cpu in pairs:
            assert on_gpu.device.type == "cuda" and on_gpu.dtype == dtype
            assert torch.equal(on_gpu.cpu(), on_cpu)


@pytest.mark.parametrize("strategy", ["allreduce", "bsp", "gossip:ring", "sfb"])
def test_a_cuda_model_trains_as_on_the_cpu(strategy: str) -> None:
    """Two ranks on one GPU train an MLP with the DistributedOptimizer; its parameters equal the CPU run's (gossip
    mixes parameters staged through host memory; SFB gathers its factors on the device and rebuilds the
    gradients there)."""
    steps, batch = 4, 8
    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(steps, 2, batch, 10, generator=gen), torch.randn(steps, 2, batch, 3, generator=gen)

    def train(device: str) -> Any:
        def worker(ctx: Context) -> dict[str, Any]:
            net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            init = torch.Generator().manual_seed(0)  # (the global seed is shared by the thread ranks)
            with torch.no_grad():
                for p in net.parameters():
                    p.copy_(torch.randn(p.shape, generator=init) * 0.3)
            net.to(device)
            sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            opt = ptt.DistributedOptimizer(sgd, model=net, strategy=strategy, bucket_bytes=256, context=ctx)
            for k in range(steps):
                opt.zero_grad()
                x, y = xs[k, ctx.rank].to(device), ys[k, ctx.rank].to(device)
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()
            opt.close()
            assert all(p.device.type == torch.device(device).type for p in net.parameters())
            return {name: p.detach().cpu() for name, p in net.named_parameters()}

        return run_ranks(2, worker, servers=1 if strategy == "bsp" else 0, timeout=60)

    for on_gpu, on_cpu in zip(train("cuda"), train("cpu"), strict=True):
        for name, value in on_cpu.items():
            torch.testing.assert_close(on_gpu[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["allreduce", "bsp", "sfb"])
def test_backward_never_waits_for_another_rank(strategy: str) -> None:
    """Rank 1 starts its backward only after rank 0's backward has returned: a gradient hook that waited for a peer
    would make rank 0 wait for ever. On a GPU this is what two thread ranks must survive, since autograd runs every
    rank's CUDA backward on its one thread per device (SFB's first allgather once made the collective choice of the
    CUDA engine there, and both ranks hung). Then both step and agree."""
    done = threading.Event()

    def worker(ctx: Context) -> list[Any]:
        net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).cuda()
        ptt.broadcast_parameters(net, context=ctx)
        sgd = torch.optim.SGD(net.parameters(), lr=0.1)
        opt = ptt.DistributedOptimizer(sgd, model=net, strategy=strategy, bucket_bytes=256, context=ctx)
        x = torch.full((8, 10), float(ctx.rank + 1), device="cuda")
        for _ in range(2):
            opt.zero_grad()
            if ctx.rank == 1:
                assert done.wait(60), "rank 0's backward did not return without rank 1"
            net(x).square().mean().backward()
            if ctx.rank == 0:
                done.set()
            opt.step()
            if ctx.rank == 1:
                done.clear()  # (before the barrier: rank 0 sets it again only after it)
            ctx.barrier()
        opt.close()
        return [p.detach().cpu() for p in net.parameters()]

    first, second = run_ranks(2, worker, servers=1 if strategy == "bsp" else 0, timeout=90)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
