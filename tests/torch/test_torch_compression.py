"""compression= of DistributedOptimizer: allreduce and the parameter server carry 16-bit, top-k and PowerSGD
gradients, every worker decodes the same mean, and the lossless settings (top-k of everything, PowerSGD of full
rank) reproduce the uncompressed mean."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.compression import TopK  # noqa: E402
from paratrain.errors import ConfigError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]


def make_net() -> Any:
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return net


def batch(rank: int, step: int = 0) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def local_grads(rank: int) -> Any:
    net = make_net()
    x, y = batch(rank)
    ((net(x) - y) ** 2).sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def synced_grads(workers: int, compression: str, *, strategy: str = "allreduce", servers: int = 0) -> list[Any]:
    def worker(ctx: Context) -> Any:
        net = make_net()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            model=net,
            strategy=strategy,
            context=ctx,
            compression=compression,
            bucket_bytes=160,  # several buckets: weights and biases in separate ones
        )
        x, y = batch(ctx.rank)
        ((net(x) - y) ** 2).sum().backward()
        opt.synchronize()
        grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        opt.close()
        return grads

    return run_ranks(workers, worker, servers=servers)


def mean_grads(workers: int) -> Any:
    return sum(local_grads(r) for r in range(workers)) / workers


@pytest.mark.parametrize(
    ("compression", "tolerance"),
    [("fp16", 2e-3), ("bf16", 2e-2), ("topk:1", 1e-6), ("powersgd:8", 1e-4)],
    ids=["fp16", "bf16", "topk-all", "powersgd-full-rank"],
)
def test_allreduce_compressed_mean_is_the_mean(compression: str, tolerance: float) -> None:
    results = synced_grads(3, compression)
    want = mean_grads(3)
    for got in results:
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        assert torch.equal(got, results[0])  # every worker decoded the same bits


def test_allreduce_top_k_is_the_mean_of_each_workers_selection() -> None:
    """top-k 25 % per bucket: the decoded gradient is the mean over workers of what each one's TopK selected
    from its own fused bucket (computed here in one thread from the same bucket plan)."""
    results = synced_grads(2, "topk:0.25")
    net = make_net()

    def plan_of(ctx: Context) -> Any:
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), model=net, bucket_bytes=160, context=ctx
        )
        opt.close()
        return opt.plan

    plan = run_ranks(1, plan_of)[0]
    sizes = [p.numel() for p in net.parameters()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    want = torch.zeros(sum(sizes))
    for rank in range(2):
        grads = local_grads(rank)
        for bucket in plan:
            flat = torch.cat([grads[starts[i] : starts[i] + sizes[i]] for i in bucket.params])
            idx, val = TopK(ratio=0.25).compress("b", flat.numpy())
            dense = torch.from_numpy(TopK.decompress(flat.numel(), idx, val, scale=0.5, dtype=flat.numpy().dtype))
            for i, off in zip(bucket.params, bucket.offsets, strict=True):
                want[starts[i] : starts[i] + sizes[i]] += dense[off : off + sizes[i]]
    assert len(plan) > 1
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_parameter_server_carries_fp16_bf16_and_top_k() -> None:
    """The servers add 16-bit pushes at float32 and top-k pushes as dense gradients: after one step the
    workers' parameters match the uncompressed run (top-k of everything: exactly up to float rounding). (bf16
    pushes arrived as uint16 and were rejected until 2026-11-27.)"""

    def train(compression: str | None) -> Any:
        def worker(ctx: Context) -> Any:
            net = make_net()
            opt = ptt.DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                model=net,
                strategy="bsp",
                context=ctx,
                compression=compression,
                bucket_bytes=160,
            )
            for step in range(3):
                opt.zero_grad()
                x, y = batch(ctx.rank, step)
                ((net(x) - y) ** 2).sum().backward()
                opt.step()
            opt.close()
            return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

        return run_ranks(2, worker, servers=1)

    plain = train(None)[0]
    for compression, tolerance in (("topk:1", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2)):
        got = train(compression)
        torch.testing.assert_close(got[0], plain, rtol=tolerance, atol=tolerance)
        assert torch.equal(got[0], got[1])
    sparse = train("topk:0.1")
    assert not torch.allclose(sparse[0], plain)  # most of the gradient waits in the residuals


def _train_steps(compression: str | None, momentum: float, steps: int = 4, workers: int = 2) -> list[Any]:
    def worker(ctx: Context) -> Any:
        net = make_net()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum),
            model=net,
            context=ctx,
            compression=compression,
            bucket_bytes=160,
        )
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(ctx.rank, step)
            ((net(x) - y) ** 2).sum().backward()
            opt.step()
        opt.close()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    return run_ranks(workers, worker)


def test_dgc_moves_the_momentum_to_the_workers() -> None:
    """dgc:R's update rule, checked three ways. Sending everything (R = 1) masks every velocity every step, so
    the step is plain SGD on the mean gradient (DGC's rule), whatever the wrapped SGD's momentum. With R < 1
    the parameters follow a one-thread replay of DGC (each worker's velocity and residual per bucket, then
    ``p -= lr · mean of the sparse sends``), identically on every worker. With momentum 0 it is topk:R."""
    plain_sgd = _train_steps(None, 0.0)[0]
    for got in _train_steps("dgc:1", 0.9):
        torch.testing.assert_close(got, plain_sgd, rtol=1e-6, atol=1e-6)

    got = _train_steps("dgc:0.3", 0.9)
    assert torch.equal(got[0], got[1])
    net = make_net()
    params = list(net.parameters())
    sizes = [p.numel() for p in params]
    plan = run_ranks(
        1,
        lambda ctx: (
            ptt.DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.1), model=net, bucket_bytes=160, context=ctx
            ).plan
        ),
    )[0]
    comps = [TopK(ratio=0.3, momentum_correction=True) for _ in range(2)]
    for step in range(4):
        update = [torch.zeros(n) for n in sizes]
        for rank in range(2):
            net.zero_grad()
            x, y = batch(rank, step)
            ((net(x) - y) ** 2).sum().backward()
            for k, bucket in enumerate(plan):
                flat = torch.cat([params[i].grad.reshape(-1) for i in bucket.params])
                idx, val = comps[rank].compress(f"b{k}", flat.numpy(), momentum=0.9)
                dense = TopK.decompress(flat.numel(), idx, val, scale=0.5, dtype=flat.numpy().dtype)
                for i, off in zip(bucket.params, bucket.offsets, strict=True):
                    update[i] += torch.from_numpy(dense[off : off + sizes[i]])
        with torch.no_grad():
            for p, u in zip(params, update, strict=True):
                p.sub_(0.1 * u.reshape(p.shape))
    want = torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)

    top = _train_steps("topk:0.3", 0.0)
    torch.testing.assert_close(_train_steps("dgc:0.3", 0.0)[0], top[0], rtol=0, atol=0)


def test_settings_that_cannot_work_are_refused() -> None:
    def worker(ctx: Context) -> list[str]:
        net = make_net()
        errors = []
        cases: list[tuple[str, str, Any]] = [
            ("bsp", "powersgd:2", torch.optim.SGD(net.parameters(), lr=0.1)),
            ("gossip:ring", "fp16", torch.optim.SGD(net.parameters(), lr=0.1)),
            ("allreduce", "zip", torch.optim.SGD(net.parameters(), lr=0.1)),
            ("bsp", "dgc:0.1", torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)),
            ("allreduce", "dgc:0.1", torch.optim.Adam(net.parameters(), lr=0.1)),
            ("allreduce", "dgc:0.1", torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)),
        ]
        for strategy, compression, inner in cases:
            with pytest.raises(ConfigError) as info:
                ptt.DistributedOptimizer(inner, model=net, strategy=strategy, context=ctx, compression=compression)
            errors.append(str(info.value))
        return errors

    errors = run_ranks(2, worker, servers=1)[0]
    assert "two aggregation rounds" in errors[0]
    assert "gossip" in errors[1]
    assert "unknown compression" in errors[2]
    assert "servers step the optimizer" in errors[3]
    assert "Adam" in errors[4] and "no SGD momentum" in errors[4]
    assert "Nesterov" in errors[5]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_casts_keep_a_tensor_a_tensor_and_send_what_wire_bytes_says(name: str) -> None:
    """A bucket's tensor is cast by torch (numpy has no bfloat16): ``cast(buffer / P)`` among the workers, the
    gradient cast for the servers, the sum back at the buffer's width; each weighs what wire_bytes says."""
    from paratrain.compression import parse_compression

    comp = parse_compression(name)
    assert comp is not None
    wire = torch.float16 if name == "fp16" else torch.bfloat16
    buffer = torch.randn(23, generator=torch.Generator().manual_seed(0))
    message = comp.encode("b", buffer, numel=20, workers=3)
    assert message.op == "sum" and torch.equal(message.array, (buffer / 3).to(wire))
    assert message.array.element_size() * message.array.numel() == comp.wire_bytes(23, 4)
    push = comp.encode_push("b", buffer[:20])
    assert push.indices is None and torch.equal(push.values, buffer[:20].to(wire))
    assert push.values.element_size() * push.values.numel() == comp.wire_bytes(20, 4, push=True)
    decoded = comp.decode("b", message.array * 3, buffer, numel=20, workers=3)
    assert decoded.dtype == torch.float32 and decoded.data_ptr() != buffer.data_ptr()
    torch.testing.assert_close(decoded, buffer, rtol=2e-2, atol=2e-2)


def test_top_k_refuses_half_precision_buckets() -> None:
    def worker(ctx: Context) -> str:
        net = make_net().half()
        with pytest.raises(ConfigError) as info:
            ptt.DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.1), model=net, context=ctx, compression="topk:0.1"
            )
        return str(info.value)

    assert "top-k compression sends float32 or float64 gradients, not torch.float16" in run_ranks(2, worker)[0]


@pytest.mark.parametrize(
    ("strategy", "servers", "chain"),
    [
        ("allreduce", 0, ["CompressedAllreduceStrategy", "AllreduceStrategy"]),
        ("bsp", 1, ["ParameterServerStrategy"]),
    ],
)
def test_compression_decorates_the_base_strategy(strategy: str, servers: int, chain: list[str]) -> None:
    """compression= is a wrapper: the kind's builder builds the base, the wrapper's decorator wraps it (allreduce)
    or has its pushes compressed (the servers)."""

    def worker(ctx: Context) -> tuple[list[str], str]:
        net = make_net()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), model=net, strategy=strategy, context=ctx, compression="fp16"
        )
        try:
            built, names = opt._strategy, []
            while built is not None:
                names.append(type(built).__name__)
                built = getattr(built, "base", None)
            return names, str(opt._strategy.compressor.name)  # type: ignore[attr-defined]
        finally:
            opt.close()

    for names, compressor in run_ranks(2, worker, servers=servers):
        assert (names, compressor) == (chain, "fp16")
