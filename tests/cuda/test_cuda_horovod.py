"""The Horovod-compatible engine with CUDA tensors: fused allreduces equal the CPU ones and stay on the device,
and a joined rank's neutral tensor goes to the device the others reduce on (so every rank's part takes one path).
Skipped without a CUDA device (CI has none); `benchmarks/gpu/run.sh` runs them on a GPU machine."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from paratrain.horovod.controller import Engine, Request  # noqa: E402
from paratrain.runtime.context import Context  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SUM, AVERAGE, MIN, MAX = 1, 0, 3, 4


def _engine(ctx: Context) -> Engine:
    group = ctx.new_group(range(ctx.world_size))
    assert group is not None
    return Engine(group, timeline=None, fusion_bytes=1 << 20, error=lambda e: RuntimeError(str(e)))


def _tensors(rank: int) -> list[Any]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(k + 1, generator=g) for k in range(8)]


def test_fused_cuda_allreduces_equal_the_cpu_ones() -> None:
    def fn(ctx: Context) -> tuple[list[Any], list[Any], dict[str, int]]:
        engine = _engine(ctx)
        results = []
        for device in ("cuda", "cpu"):
            with engine._cond:  # one cycle sees every request: they are fused
                futures = [
                    engine.submit(Request(f"{device}.{op}.{k}", "allreduce", t.to(device), op))
                    for op in (SUM, AVERAGE)
                    for k, t in enumerate(_tensors(ctx.rank))
                ]
            results.append([f.result(timeout=60) for f in futures])
        engine.close(10)
        return results[0], results[1], dict(engine.stats)

    for on_gpu, on_cpu, stats in run_ranks(2, fn, timeout=90):
        assert stats["fused_messages"] >= 2
        for got, want in zip(on_gpu, on_cpu, strict=True):
            assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


def test_a_joined_rank_takes_part_with_a_neutral_tensor_on_the_device() -> None:
    def fn(ctx: Context) -> tuple[list[Any], int]:
        engine = _engine(ctx)
        out = []
        if ctx.rank == 0:  # rank 1 joins at once: its parts are neutral, made on its current GPU
            x = torch.tensor([1.0, -2.0, 3.0], device="cuda")
            out = [engine.submit(Request(f"j{op}", "allreduce", x, op)).result(timeout=60) for op in (SUM, MIN, MAX)]
        last = engine.submit(Request("join", "join")).result(timeout=60)
        engine.close(10)
        return out, last

    (out, last0), (_, last1) = run_ranks(2, fn, timeout=90)
    assert (last0, last1) == (0, 0)
    for got in out:
        assert got.device.type == "cuda" and got.cpu().tolist() == [1.0, -2.0, 3.0]
