"""The parameter-server strategies: BSP equals one process on the concatenated batches; SSP and ASP learn."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.errors import ConfigError  # noqa: E402
from paratrain.ps import KVStore  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]

IN, HID, OUT, BATCH, STEPS = 4, 6, 2, 5, 5


def make_net(seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return net


def make_data(world_size: int, steps: int = STEPS) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(99)
    return torch.randn(steps, world_size, BATCH, IN, generator=gen), torch.randn(
        steps, world_size, BATCH, OUT, generator=gen
    )


OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum-decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_bsp_equals_single_process_on_concatenated_batches(world_size: int, servers: int, optimizer: str) -> None:
    """The servers average a clock's gradients and take one step: synchronous SGD (or Adam, Adagrad)."""
    xs, ys = make_data(world_size)

    def worker(ctx: Context) -> dict[str, Any]:
        net = make_net(seed=20 + ctx.rank)  # different inits: the servers take rank 0's
        opt = ptt.DistributedOptimizer(
            OPTIMIZERS[optimizer](net.parameters()), model=net, strategy="bsp", bucket_bytes=64, context=ctx
        )
        assert len(opt.plan) > 1
        for k in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(xs[k, ctx.rank]), ys[k, ctx.rank]).backward()
            opt.step()
        # the local optimizer never stepped: its state lives on the servers (Adagrad makes its own at once)
        assert all(float(state.get("step", 0)) == 0 for state in opt.state.values())
        opt.close()
        return {name: p.detach().clone() for name, p in net.named_parameters()}

    results = run_ranks(world_size, worker, servers=servers, timeout=30)
    net = make_net(seed=20)
    opt = OPTIMIZERS[optimizer](net.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xs[k].reshape(-1, IN)), ys[k].reshape(-1, OUT)).backward()
        opt.step()
    for result in results:
        for name, p in net.named_parameters():
            torch.testing.assert_close(result[name], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ssp:3", "asp"])
@pytest.mark.parametrize("optimizer", ["sgd-momentum-decay", "adam"])
def test_one_worker_ssp_and_asp_equal_plain_torch(strategy: str, optimizer: str) -> None:
    """With one worker there is nothing stale: every round is one push, one server step, as torch's own step."""
    xs, ys = make_data(1)

    def worker(ctx: Context) -> dict[str, Any]:
        net = make_net(seed=3)
        opt = ptt.DistributedOptimizer(
            OPTIMIZERS[optimizer](net.parameters()), model=net, strategy=strategy, bucket_bytes=64, context=ctx
        )
        for k in range(STEPS):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(xs[k, 0]), ys[k, 0]).backward()
            opt.step()
        opt.close()
        return {name: p.detach().clone() for name, p in net.named_parameters()}

    (result,) = run_ranks(1, worker, servers=2, timeout=30)
    net = make_net(seed=3)
    opt = OPTIMIZERS[optimizer](net.parameters())
    for k in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xs[k, 0]), ys[k, 0]).backward()
        opt.step()
    for name, p in net.named_parameters():
        torch.testing.assert_close(result[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_staleness_lr_is_for_the_server_strategies_only() -> None:
    def worker(ctx: Context) -> None:
        net = make_net(seed=1)
        with pytest.raises(ConfigError, match="staleness_lr"):
            ptt.DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.1), model=net, strategy="allreduce", staleness_lr=True
            )

    run_ranks(1, worker)


@pytest.mark.parametrize("strategy", ["ssp:2", "asp"])
def test_ssp_and_asp_reduce_the_loss(strategy: str) -> None:
    """A linear regression with a known answer: stale or not, the workers get much closer to it."""
    world_size, steps = 2, 30
    gen = torch.Generator().manual_seed(5)
    true_w = torch.randn(OUT, IN, generator=gen)
    xs = torch.randn(world_size, 64, IN, generator=gen)
    ys = xs @ true_w.T

    def loss(model: Any) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(xs.reshape(-1, IN)), ys.reshape(-1, OUT)))

    def worker(ctx: Context) -> tuple[float, float]:
        model = torch.nn.Linear(IN, OUT, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, strategy=strategy, context=ctx
        )
        before = loss(model)
        for k in range(steps):
            opt.zero_grad()
            batch = slice(8 * (k % 8), 8 * (k % 8) + 8)
            torch.nn.functional.mse_loss(model(xs[ctx.rank, batch]), ys[ctx.rank, batch]).backward()
            opt.step()
        opt.close()
        return before, loss(model)

    for before, after in run_ranks(world_size, worker, servers=1, timeout=30):
        assert after < 0.2 * before


def test_lr_change_warns_once_that_servers_keep_their_hyperparameters() -> None:
    def worker(ctx: Context) -> int:
        net = make_net(seed=1)
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), model=net, strategy="asp", context=ctx
        )
        opt.param_groups[0]["lr"] = 0.05
        with pytest.warns(RuntimeWarning, match="keep those of construction"):
            opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()  # no second warning
        opt.close()
        return 0

    run_ranks(1, worker, servers=1)


def test_server_strategies_refuse_optimizers_the_servers_lack() -> None:
    def worker(ctx: Context) -> None:
        net = make_net(seed=1)
        with pytest.raises(ConfigError, match="AdamW"):
            ptt.DistributedOptimizer(torch.optim.AdamW(net.parameters()), model=net, strategy="bsp", context=ctx)
        with pytest.raises(ConfigError, match=r"2\.weight, 2\.bias require grad but are not in the optimizer"):
            ptt.DistributedOptimizer(
                torch.optim.SGD(net[0].parameters(), lr=0.1), model=net, strategy="bsp", context=ctx
            )

    run_ranks(1, worker, servers=1)


def test_pull_into_a_tensor_and_bfloat16_pushes() -> None:
    """``kv.pull(key, out=tensor)``: a contiguous CPU tensor is filled in place, a strided one through a copy, a
    wrong shape or dtype is an error (CUDA tensors: tests/cuda). bfloat16 pushes are added to a float32 key (they
    arrived as uint16 and were rejected before); a bfloat16 key is refused (its bits cannot be added)."""

    def worker(ctx: Context) -> list[Any]:
        kv = KVStore(context=ctx)
        kv.init("w", np.arange(6, dtype=np.float32).reshape(2, 3))
        with pytest.raises(TypeError, match="bfloat16 keys are not supported"):
            kv.init("b", torch.zeros(2, dtype=torch.bfloat16))
        kv.push("w", torch.full((2, 3), 0.5, dtype=torch.bfloat16)).wait(30)
        kv.push_rows("w", [1], torch.ones(1, 3, dtype=torch.bfloat16)).wait(30)
        kv.clock()
        dense = torch.zeros(2, 3)
        pointer = dense.data_ptr()
        assert kv.pull("w", out=dense) is dense and dense.data_ptr() == pointer
        strided = torch.zeros(3, 2).t()
        kv.pull("w", out=strided)
        with pytest.raises(ValueError, match="must be of shape"):
            kv.pull("w", out=torch.zeros(3, 2))
        with pytest.raises(ValueError, match="dtype float32"):
            kv.pull("w", out=torch.zeros(2, 3, dtype=torch.float64))
        kv.close()
        return [dense, strided]

    expected = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 1.0
    expected[1] += 2.0
    for dense, strided in run_ranks(2, worker, servers=1, timeout=30):
        assert torch.equal(dense, expected) and torch.equal(strided, expected)


@pytest.mark.parametrize("strategy", ["bsp", "ssp:2"])
def test_replicated_servers_train_as_unreplicated_ones(strategy: str) -> None:
    """With ``replicas=2`` a push is acknowledged once its round's state reached the backup, so the strategy waits
    for its pushes after the clock, not before; the model is bitwise the unreplicated run's (under BSP: SSP's reads
    depend on timing), and the backups' copies equal the owners'."""
    world_size, steps = 2, 6
    xs, ys = make_data(world_size, steps)

    def train(replicas: int) -> Callable[[Context], Any]:
        def worker(ctx: Context) -> tuple[dict[str, Any], bool]:
            ctx = Context(settings=dataclasses.replace(ctx.settings, ps_replicas=replicas), transport=ctx.transport)
            net = make_net(seed=20 + ctx.rank)
            sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            opt = ptt.DistributedOptimizer(sgd, model=net, strategy=strategy, bucket_bytes=64, context=ctx)
            for k in range(steps):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(xs[k, ctx.rank]), ys[k, ctx.rank]).backward()
                opt.step()
            strat = opt._strategy
            assert isinstance(strat, ptt.strategies.ParameterServerStrategy)
            for _ in range(3):
                strat.kv.clock()
            agree = all(
                all(np.array_equal(copies[0], c) for c in copies[1:])
                for copies in (strat.kv.pull_replicas(key) for key in strat._keys)
            )
            opt.close()
            return {name: p.detach().clone() for name, p in net.named_parameters()}, agree

        return worker

    plain = run_ranks(world_size, train(1), servers=2, timeout=30)
    replicated = run_ranks(world_size, train(2), servers=2, timeout=30)
    for (a, _), (b, agree) in zip(plain, replicated, strict=True):
        assert agree
        for name in a:
            if strategy == "bsp":
                torch.testing.assert_close(b[name], a[name], rtol=0, atol=0)
            else:
                assert torch.isfinite(b[name]).all()
