"""CUDA tensors through torch.distributed's engines (:mod:`paratrain.collectives.torch_engines`): the automatic choice
(NCCL where every rank has a GPU of its own, staging where ranks share one), the override, and results equal to
the CPU calls. Skipped without a CUDA device (CI has none); `benchmarks/gpu/run.sh` runs them on a GPU machine.
With one GPU, NCCL runs at world size 1 only (NCCL refuses two ranks on one device); Gloo, which takes CUDA
tensors too, runs two thread ranks on the one GPU through the same engine path."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.errors import ConfigError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]


def _data(rank: int, dtype: Any) -> Any:
    return (torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1) - 7).to(dtype)


def _pairs(ctx: Context, x: Any) -> list[tuple[Any, Any]]:
    """(call on the CUDA tensor, the same call on the CPU tensor) for every collective."""
    pairs = [(ctx.allreduce(x.cuda(), op=op), ctx.allreduce(x, op=op)) for op in ("sum", "mean", "max")]
    inplace = x.cuda()
    assert ctx.allreduce_(inplace) is inplace
    pairs.append((inplace, ctx.allreduce(x)))
    strided = x.cuda().t()
    ctx.allreduce_(strided)
    pairs.append((strided, ctx.allreduce(x).t()))
    pairs.append((ctx.allreduce_async(x.cuda(), op="min").wait(), ctx.allreduce(x, op="min")))
    pairs.append((ctx.broadcast(x.cuda(), root=ctx.world_size - 1), ctx.broadcast(x, root=ctx.world_size - 1)))
    pairs.append((ctx.allgather(x.cuda()[: ctx.rank + 1]), ctx.allgather(x[: ctx.rank + 1])))
    pairs.append((ctx.reduce_scatter(x.cuda()), ctx.reduce_scatter(x)))
    return pairs


def _check(pairs: list[tuple[Any, Any]], dtype: Any) -> None:
    for on_gpu, on_cpu in pairs:
        assert on_gpu.device.type == "cuda" and on_gpu.dtype == dtype
        assert torch.equal(on_gpu.cpu(), on_cpu)


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_nccl_available()), reason="needs NCCL"
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_rank_on_its_own_gpu_gets_nccl(dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARATRAIN_CUDA_COLLECTIVES", raising=False)

    def worker(ctx: Context) -> tuple[list[tuple[Any, Any]], str, int]:
        pairs = _pairs(ctx, _data(ctx.rank, dtype))
        engine = ctx.collectives.engines["cuda"]
        return pairs, engine.name, engine.calls

    ((pairs, name, calls),) = run_ranks(1, worker, timeout=120)
    _check(pairs, dtype)
    assert name == "nccl" and calls == len(pairs)  # one work item per CUDA call


def test_ranks_sharing_the_gpu_stage_through_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARATRAIN_CUDA_COLLECTIVES", raising=False)

    def worker(ctx: Context) -> tuple[list[tuple[Any, Any]], dict[str, Any]]:
        pairs = _pairs(ctx, _data(ctx.rank, torch.float32))
        return pairs, dict(ctx.collectives.engines)

    for pairs, engines in run_ranks(2, worker, timeout=120):
        _check(pairs, torch.float32)
        assert engines == {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gloo_takes_cuda_tensors_when_asked(dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARATRAIN_CUDA_COLLECTIVES", "gloo")

    def worker(ctx: Context) -> tuple[list[tuple[Any, Any]], int]:
        pairs = _pairs(ctx, _data(ctx.rank, dtype))
        return pairs, ctx.collectives.engines["cuda"].calls

    for pairs, calls in run_ranks(2, worker, timeout=120):
        _check(pairs, dtype)
        assert calls == len(pairs) - 2  # Gloo runs allgather and reduce_scatter on CPU tensors only: staged


def test_insisting_on_nccl_with_a_shared_gpu_is_the_same_error_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARATRAIN_CUDA_COLLECTIVES", "nccl")

    def worker(ctx: Context) -> str:
        with pytest.raises(ConfigError) as info:
            ctx.allreduce(torch.ones(2, device="cuda"))
        with pytest.raises(ConfigError):  # and at every later call on a CUDA tensor
            ctx.allreduce(torch.ones(2, device="cuda"))
        assert ctx.allreduce(torch.ones(2)).tolist() == [2.0, 2.0]  # CPU tensors are unaffected
        return str(info.value)

    first, second = run_ranks(2, worker, timeout=120)
    assert first == second and "share GPU" in first


def test_device_buckets_through_an_engine_train_as_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an engine for CUDA tensors the allreduce strategy's buckets stay on the GPU (gradients are views of
    them) and the allreduce reads device memory; the parameters equal the CPU run's."""
    monkeypatch.setenv("PARATRAIN_CUDA_COLLECTIVES", "gloo")
    steps, batch = 4, 8
    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(steps, 2, batch, 10, generator=gen), torch.randn(steps, 2, batch, 3, generator=gen)

    def train(device: str) -> Any:
        def worker(ctx: Context) -> dict[str, Any]:
            net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            init = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in net.parameters():
                    p.copy_(torch.randn(p.shape, generator=init) * 0.3)
            net.to(device)
            sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            opt = ptt.DistributedOptimizer(sgd, model=net, bucket_bytes=256, context=ctx)
            assert all(b.buffer.device.type == device for b in opt._buckets if b is not None)
            for k in range(steps):
                opt.zero_grad(set_to_none=False)
                torch.nn.functional.mse_loss(net(xs[k, ctx.rank].to(device)), ys[k, ctx.rank].to(device)).backward()
                opt.step()
            opt.close()
            return {name: p.detach().cpu() for name, p in net.named_parameters()}

        return run_ranks(2, worker, timeout=120)

    for on_gpu, on_cpu in zip(train("cuda"), train("cpu"), strict=True):
        for name, value in on_cpu.items():
            torch.testing.assert_close(on_gpu[name], value, rtol=1e-5, atol=1e-6)
