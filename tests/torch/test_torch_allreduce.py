"""The "allreduce" strategy equals one process training on the concatenated batches (the acceptance test).

Every worker starts from a different random init, ``broadcast_parameters`` makes them equal, and each trains on
its own batch; a single process trains the root's init on the concatenation of all batches with the mean loss.
Data parallelism is exact when the parameters agree to float rounding after several momentum steps: with
several small buckets, one big bucket, gradients kept as bucket views or set to None, parameters nobody uses
and parameters only some workers use.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.errors import ConfigError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]

IN, HID, OUT, BATCH, STEPS = 5, 7, 3, 4, 5
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 0.01


class Net(torch.nn.Module):  # type: ignore[misc]
    """Two layers, a layer nobody calls, a side layer only some workers call, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        # registered first, so last in the plan: buckets wait for their predecessors, and a bucket holding a
        # parameter without gradient only leaves in step(), so the early buckets hold the used layers
        self.unused = torch.nn.Linear(OUT, OUT)
        self.side = torch.nn.Linear(IN, OUT)
        self.fc1 = torch.nn.Linear(IN, HID)
        self.fc2 = torch.nn.Linear(HID, OUT)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: Any, use_side: bool = False) -> Any:
        out = self.fc2(torch.tanh(self.fc1(x))) * self.scale
        return out + self.side(x) if use_side else out


def make_net(seed: int) -> Net:
    """A net initialised from ``seed`` alone (no global RNG: ranks are threads)."""
    net = Net()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        net.scale.fill_(1.0 + 0.1 * seed)
    return net


def make_data(world_size: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS, world_size, BATCH, IN, generator=gen), torch.randn(
        STEPS, world_size, BATCH, OUT, generator=gen
    )


def make_sgd(net: Net) -> Any:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def side_used(rank: int, mode: str) -> bool:
    return mode == "all" or (mode == "rank0" and rank == 0)


def train_distributed(
    world_size: int, *, bucket_bytes: int, set_to_none: bool = True, side: str = "none", transport: str = "inproc"
) -> list[dict[str, Any]]:
    xs, ys = make_data(world_size)

    def worker(ctx: Context) -> dict[str, Any]:
        net = make_net(seed=10 + ctx.rank)  # a different init on every rank
        ptt.broadcast_parameters(net, context=ctx)
        opt = ptt.DistributedOptimizer(make_sgd(net), model=net, bucket_bytes=bucket_bytes, context=ctx)
        launched_in_backward = []
        for k in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            loss = torch.nn.functional.mse_loss(net(xs[k, ctx.rank], side_used(ctx.rank, side)), ys[k, ctx.rank])
            loss.backward()
            launched_in_backward.append(opt.launched)
            opt.step()
        opt.close()
        return {
            "params": {name: p.detach().clone() for name, p in net.named_parameters()},
            "scale": net.scale.clone(),
            "unused_grad": net.unused.weight.grad,
            "buckets": len(opt.plan),
            "launched_in_backward": launched_in_backward,
        }

    return run_ranks(world_size, worker, timeout=30, transport=transport)


def train_single(world_size: int, *, side: str = "none", set_to_none: bool = True) -> Net:
    """One process, rank 0's init, every worker's batch at once, mean loss."""
    xs, ys = make_data(world_size)
    net = make_net(seed=10)
    opt = make_sgd(net)
    for k in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        if side == "none":
            loss = torch.nn.functional.mse_loss(net(xs[k].reshape(-1, IN)), ys[k].reshape(-1, OUT))
        else:  # equal batches: the mean over all samples is the mean of the per-worker means
            losses = [
                torch.nn.functional.mse_loss(net(xs[k, r], side_used(r, side)), ys[k, r]) for r in range(world_size)
            ]
            loss = torch.stack(losses).mean()
        loss.backward()
        opt.step()
    return net


def assert_same(results: list[dict[str, Any]], reference: Net) -> None:
    for rank, result in enumerate(results):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(
                result["params"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, r=rank, n=name: f"{r} {n}: {m}"
            )
        assert torch.equal(result["scale"], reference.scale)  # buffers come from the root too
    for result in results[1:]:  # the workers agree bit for bit: they apply the same averaged gradients
        for name in result["params"]:
            assert torch.equal(result["params"][name], results[0]["params"][name])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("bucket_bytes", "buckets"),
    [(1, 8), (128, None), (1 << 20, 1)],
    ids=["bucket-per-param", "small-buckets", "one-bucket"],
)
def test_allreduce_equals_single_process_on_concatenated_batches(
    world_size: int, bucket_bytes: int, buckets: int | None
) -> None:
    results = train_distributed(world_size, bucket_bytes=bucket_bytes)
    assert_same(results, train_single(world_size))
    count = results[0]["buckets"]
    assert count == buckets if buckets is not None else 1 < count < 8
    if count > 1:
        # the buckets of fc2 and fc1 left during backward; those of the unused layers wait for step()
        assert all(1 <= n < count for n in results[0]["launched_in_backward"])


def test_allreduce_over_sockets_and_shared_memory() -> None:
    """Real ZeroMQ transports on one host: allreduce goes through the shared-memory algorithm."""
    results = train_distributed(2, bucket_bytes=128, transport="zmq")
    assert_same(results, train_single(2))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-none", "grads-as-bucket-views"])
@pytest.mark.parametrize("side", ["none", "rank0", "all"])
def test_unused_parameters(world_size: int, set_to_none: bool, side: str) -> None:
    """Nobody uses ``unused``: it keeps grad None and is never decayed. ``side`` may be used by some ranks only."""
    results = train_distributed(world_size, bucket_bytes=128, set_to_none=set_to_none, side=side)
    reference = train_single(world_size, side=side, set_to_none=set_to_none)
    assert_same(results, reference)
    assert reference.unused.weight.grad is None
    assert all(r["unused_grad"] is None for r in results)
    start = make_net(seed=10).unused.weight
    assert torch.equal(results[0]["params"]["unused.weight"], start.detach())


def test_gradient_accumulation_with_no_sync() -> None:
    """Two micro-batches per worker, the first inside no_sync: one step on the sum of their gradients."""
    world_size = 2
    xs, ys = make_data(world_size * 2)

    def loss_of(net: Net, k: int, part: int) -> Any:
        return torch.nn.functional.mse_loss(net(xs[k, part]), ys[k, part])

    def worker(ctx: Context) -> dict[str, Any]:
        net = make_net(seed=10 + ctx.rank)
        ptt.broadcast_parameters(net, context=ctx)
        with ptt.DistributedOptimizer(make_sgd(net), model=net, bucket_bytes=64, context=ctx) as opt:
            for k in range(3):
                opt.zero_grad()
                with opt.no_sync():
                    loss_of(net, k, 2 * ctx.rank).backward()
                    assert opt.launched == 0
                loss_of(net, k, 2 * ctx.rank + 1).backward()
                opt.step()
        return {name: p.detach().clone() for name, p in net.named_parameters()}

    results = run_ranks(world_size, worker, timeout=30)
    net = make_net(seed=10)
    opt = make_sgd(net)
    for k in range(3):
        opt.zero_grad()
        (sum(loss_of(net, k, part) for part in range(2 * world_size)) / world_size).backward()
        opt.step()
    for result in results:
        for name, p in net.named_parameters():
            torch.testing.assert_close(result[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_second_backward_without_step_is_an_error() -> None:
    def worker(ctx: Context) -> str:
        net = make_net(seed=1)
        opt = ptt.DistributedOptimizer(make_sgd(net), model=net, context=ctx)
        x = torch.ones(2, IN)
        net(x).sum().backward()
        try:
            net(x).sum().backward()
        except RuntimeError as exc:
            return str(exc)
        finally:
            opt.step()
            opt.close()
        return "no error"

    message = run_ranks(1, worker)[0]
    assert "second gradient before step()" in message and "no_sync" in message


def test_synchronize_then_clip_then_step() -> None:
    """synchronize() exposes the averaged gradients (e.g. to clip them); step() does not communicate again."""
    xs, ys = make_data(2)

    def worker(ctx: Context) -> tuple[Any, Any]:
        net = make_net(seed=3)
        opt = ptt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR), model=net, context=ctx)
        torch.nn.functional.mse_loss(net(xs[0, ctx.rank]), ys[0, ctx.rank]).backward()
        opt.synchronize()
        grad = net.fc1.weight.grad.clone()
        opt.synchronize()  # idempotent
        opt.step()
        opt.close()
        return grad, net.fc1.weight.detach().clone()

    (g0, w0), (g1, w1) = run_ranks(2, worker)
    net = make_net(seed=3)
    torch.nn.functional.mse_loss(net(xs[0].reshape(-1, IN)), ys[0].reshape(-1, OUT)).backward()
    torch.testing.assert_close(g0, net.fc1.weight.grad)
    assert torch.equal(g0, g1) and torch.equal(w0, w1)


def test_is_an_optimizer_for_lr_schedulers() -> None:
    def worker(ctx: Context) -> list[float]:
        net = make_net(seed=1)
        inner = torch.optim.SGD(net.parameters(), lr=1.0)
        opt = ptt.DistributedOptimizer(inner, model=net, context=ctx)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        lrs = []
        for _ in range(3):
            opt.zero_grad()
            net(torch.ones(1, IN)).sum().backward()
            opt.step()
            scheduler.step()
            lrs.append(inner.param_groups[0]["lr"])
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        assert opt.state_dict()["param_groups"][0]["lr"] == lrs[-1]
        opt.close()
        return lrs

    assert run_ranks(1, worker)[0] == [0.5, 0.25, 0.125]


def test_close_removes_the_hooks() -> None:
    def worker(ctx: Context) -> int:
        net = make_net(seed=1)
        opt = ptt.DistributedOptimizer(make_sgd(net), model=net, context=ctx)
        opt.close()
        opt.close()
        net(torch.ones(1, IN)).sum().backward()  # no hook left to fire
        with pytest.raises(ConfigError, match="closed"):
            opt.step()
        return opt.launched

    assert run_ranks(1, worker) == [0]


def test_validation() -> None:
    def worker(ctx: Context) -> None:
        net = make_net(seed=1)
        sgd = make_sgd(net)
        with pytest.raises(ConfigError, match="'allreduce', 'bsp', 'ssp:S', 'asp'"):
            ptt.DistributedOptimizer(sgd, model=net, strategy="ring", context=ctx)
        with pytest.raises(ConfigError, match="neither one of ring"):
            ptt.DistributedOptimizer(sgd, model=net, strategy="gossip:star", context=ctx)
        with pytest.raises(ConfigError, match="bucket_bytes"):
            ptt.DistributedOptimizer(sgd, model=net, bucket_bytes=0, context=ctx)
        with pytest.raises(ConfigError, match="not in the model"):
            ptt.DistributedOptimizer(make_sgd(make_net(seed=2)), model=net, context=ctx)
        with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
            ptt.DistributedOptimizer(object(), model=net, context=ctx)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="no parameter servers"):
            ptt.DistributedOptimizer(sgd, model=net, strategy="bsp", context=ctx)
        with ptt.DistributedOptimizer(sgd, model=net, context=ctx) as opt:
            with pytest.raises(TypeError, match="already a DistributedOptimizer"):
                ptt.DistributedOptimizer(opt, model=net, context=ctx)
            with pytest.raises(ConfigError, match="add the group"):
                opt.add_param_group({"params": []})
            assert "strategy='allreduce'" in repr(opt)

    run_ranks(1, worker)
