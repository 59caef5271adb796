"""Sufficient-factor broadcasting rebuilds exactly the mean of the workers' dense gradients, and the hybrid
strategies (``sfb``, ``poseidon:allreduce``, ``poseidon`` with parameter servers) train to the same parameters as
``allreduce``.

The reference is computed in one thread: each worker's own loss gradient, averaged. Models are float64 so that
"equal" can be tight (1e-12 relative): SFB sums the same products in another order than autograd + allreduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.errors import ConfigError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]

IN, HID, OUT = 6, 5, 3


class Net(torch.nn.Module):  # type: ignore[misc]
    """A layer with bias, one without, a layer applied twice, and a conv-free non-Linear parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HID)
        self.mid = torch.nn.Linear(HID, HID, bias=False)  # applied twice per forward
        self.fc2 = torch.nn.Linear(HID, OUT)
        self.gain = torch.nn.Parameter(torch.ones(OUT))  # not a Linear: always dense

    def forward(self, x: Any) -> Any:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))
        return self.fc2(h) * self.gain


def make_net(seed: int = 0) -> Net:
    gen = torch.Generator().manual_seed(seed)
    net = Net().double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return net


def batch_of(rank: int, step: int, rows: int, *, seq: int = 0) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    shape = (rows, seq, IN) if seq else (rows, IN)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = torch.randn((*shape[:-1], OUT), generator=gen, dtype=torch.float64)
    return x, y


def loss_of(net: Any, x: Any, y: Any) -> Any:
    return ((net(x) - y) ** 2).sum()


def reference_grads(rows: list[int], *, seq: int = 0) -> dict[str, Any]:
    """The mean over workers of each worker's gradient (one thread, no communication)."""
    total: dict[str, Any] = {}
    for rank, k in enumerate(rows):
        net = make_net()
        if k:
            loss_of(net, *batch_of(rank, 0, k, seq=seq)).backward()
        for name, p in net.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            total[name] = total.get(name, 0) + g / len(rows)
    return total


def distributed_grads(strategy: str, rows: list[int], *, seq: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    def worker(ctx: Context) -> dict[str, Any]:
        net = make_net()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), model=net, strategy=strategy, context=ctx, **kwargs
        )
        k = rows[ctx.rank]
        if k:
            loss_of(net, *batch_of(ctx.rank, 0, k, seq=seq)).backward()
        opt.synchronize()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.close()
        return grads

    return run_ranks(len(rows), worker)


def assert_close(got: dict[str, Any], want: dict[str, Any], rtol: float = 1e-12) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "rows",
    [
        [4, 4],  # K < min(M, N)
        [1, 1, 1],  # K = 1
        [9, 3, 7, 12],  # K > min(M, N) (SFB is then dearer, but still exact) and unequal batches
    ],
    ids=["k4-p2", "k1-p3", "uneven-p4"],
)
def test_sfb_gradients_equal_the_mean_dense_gradient(rows: list[int]) -> None:
    results = distributed_grads("sfb", rows)
    want = reference_grads(rows)
    for got in results:
        assert_close(got, want)
    for got in results[1:]:  # every worker rebuilt the identical gradient, bit for bit
        for name in got:
            assert torch.equal(got[name], results[0][name]), name


def test_sfb_with_sequences_and_a_worker_without_data() -> None:
    """Inputs with a sequence dimension (K = batch x length rows) and a worker that ran no backward at all:
    it sends no rows and gets the mean with zeros, as allreduce gives."""
    rows = [3, 0, 2]
    results = distributed_grads("sfb", rows, seq=4)
    want = reference_grads(rows, seq=4)
    for got in results:
        assert_close(got, want)


def test_sfb_accumulates_micro_batches_in_no_sync() -> None:
    def worker(ctx: Context) -> dict[str, Any]:
        net = make_net()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), model=net, strategy="sfb", context=ctx
        )
        x, y = batch_of(ctx.rank, 0, 6)
        with opt.no_sync():
            loss_of(net, x[:2], y[:2]).backward()
        loss_of(net, x[2:], y[2:]).backward()
        opt.synchronize()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.close()
        return grads

    want = reference_grads([6, 6])
    for got in run_ranks(2, worker):
        assert_close(got, want)


def train(strategy: str, *, workers: int = 2, steps: int = 4, servers: int = 0, **kwargs: Any) -> list[Any]:
    """Final parameters of every worker after ``steps`` of SGD with momentum on different data per worker."""

    def worker(ctx: Context) -> Any:
        net = make_net(seed=ctx.rank)  # different inits: the strategy (or the broadcast) must make them agree
        ptt.broadcast_parameters(net, context=ctx)
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
            model=net,
            strategy=strategy,
            context=ctx,
            **kwargs,
        )
        for step in range(steps):
            opt.zero_grad()
            loss_of(net, *batch_of(ctx.rank, step, 5)).backward()
            opt.step()
        opt.close()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    return run_ranks(workers, worker, servers=servers)


Check = Callable[[list[Any]], None]


@pytest.mark.parametrize(
    ("strategy", "servers", "kwargs"),
    [
        ("sfb", 0, {}),
        ("poseidon:allreduce", 0, {"batch_size": 5, "layer_schemes": {"fc1": "sfb", "fc2": "dense"}}),
        ("poseidon", 1, {"batch_size": 5, "layer_schemes": {"fc1": "sfb", "mid": "sfb"}}),
    ],
    ids=["sfb", "poseidon-allreduce", "poseidon-ps"],
)
def test_hybrid_trains_to_the_allreduce_parameters(strategy: str, servers: int, kwargs: dict[str, Any]) -> None:
    reference = train("allreduce", workers=3)
    results = train(strategy, workers=3, servers=servers, **kwargs)
    for got in results:
        torch.testing.assert_close(got, reference[0], rtol=1e-10, atol=1e-12)
    for got in results[1:]:
        assert torch.equal(got, results[0])


def test_plan_puts_each_sfb_layer_in_a_unit_of_its_own() -> None:
    def worker(ctx: Context) -> Any:
        net = make_net()
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            model=net,
            strategy="poseidon:allreduce",
            context=ctx,
            batch_size=2,
            layer_schemes={"mid": "sfb", "fc1": "dense"},
        )
        plan = opt.hybrid_plan
        units = [(b.params, b.group) for b in opt.plan]
        opt.close()
        return plan, units

    plan, units = run_ranks(2, worker)[0]
    assert plan is not None
    # fc2 (3x5 + 3, float64), 2 workers, 2 rows: SFB 1 x 2 x 8 x 8 = 128 B, the ring 2 x 1/2 x 18 x 8 = 144 B
    assert [(c.layer.name, c.scheme, c.forced) for c in plan.choices] == [
        ("(root)", "allreduce", False),  # the root module's own parameter, gain: not a Linear
        ("fc1", "allreduce", True),
        ("mid", "sfb", True),
        ("fc2", "sfb", False),
    ]
    # parameters in model.parameters() order: gain 0, fc1.weight 1, fc1.bias 2, mid.weight 3, fc2.weight 4,
    # fc2.bias 5; each SFB layer is a unit of its own, in the order backward reaches it
    assert units == [((5, 4), 1), ((3,), 0), ((2, 1, 0), -1)]


def test_bad_settings_are_refused_with_the_reason() -> None:
    def worker(ctx: Context) -> list[str]:
        net = make_net()
        errors = []
        for strategy, kwargs in (
            ("poseidon:allreduce", {}),  # no batch size: the cost model needs it
            ("allreduce", {"batch_size": 4}),
            ("sfb", {"layer_schemes": {"(root)": "sfb"}}),  # the root's gain: not a Linear
            ("sfb", {"layer_schemes": {"nope": "sfb"}}),
            ("poseidon:allreduce", {"batch_size": 4, "layer_schemes": {"fc1": "ps"}}),
        ):
            with pytest.raises(ConfigError) as info:
                ptt.DistributedOptimizer(
                    torch.optim.SGD(net.parameters(), lr=0.1), model=net, strategy=strategy, context=ctx, **kwargs
                )
            errors.append(str(info.value))
        return errors

    errors = run_ranks(1, worker)[0]
    assert "batch_size" in errors[0]
    assert "poseidon" in errors[1]
    assert "only torch.nn.Linear" in errors[2]
    assert "no layer named 'nope'" in errors[3]
    assert "not available" in errors[4]


@pytest.mark.parametrize(("strategy", "servers"), [("allreduce", 0), ("sfb", 0), ("bsp", 1)])
def test_overlap_off_sends_nothing_during_backward_and_changes_nothing(strategy: str, servers: int) -> None:
    """overlap=False (wait-free backprop off): no unit starts during backward, all start in step(), and the
    parameters after training are bitwise those of overlap=True."""

    def run(overlap: bool) -> Any:
        def worker(ctx: Context) -> Any:
            net = make_net()
            opt = ptt.DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                model=net,
                strategy=strategy,
                context=ctx,
                overlap=overlap,
                bucket_bytes=64,
            )
            launched = []
            for step in range(3):
                opt.zero_grad()
                loss_of(net, *batch_of(ctx.rank, step, 4)).backward()
                launched.append(opt.launched)
                opt.step()
            opt.close()
            return launched, torch.cat([p.detach().reshape(-1) for p in net.parameters()])

        return run_ranks(2, worker, servers=servers)

    on, off = run(True), run(False)
    assert all(n > 0 for n in on[0][0])  # with overlap, units leave during backward
    assert all(n == 0 for rank in off for n in rank[0])
    assert torch.equal(on[0][1], off[0][1]) and torch.equal(off[0][1], off[1][1])
