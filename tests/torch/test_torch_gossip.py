"""The ``"gossip:TOPOLOGY"`` strategy (D-PSGD): workers reach consensus, the loss falls, results = one process.

Four workers (threads) each fit a shared linear-regression target on their own data, starting from different
initialisations. Gossip must pull their parameters together (the consensus distance shrinks) while the loss
falls, and every worker's parameters must equal those of D-PSGD simulated in one process.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.errors import ConfigError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402
from paratrain.torch.strategies import StrategySpec, parse_strategy  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_thread")]

WORKERS, IN, OUT, BATCH, STEPS, LR = 4, 6, 2, 16, 40, 0.05


def make_model(seed: int) -> torch.nn.Module:
    """A linear model initialised from ``seed`` alone (no global RNG: ranks are threads)."""
    model = torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, OUT))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch of step ``step``: its own samples of one shared target."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, IN, generator=gen)
    target = torch.linspace(-1, 1, IN * OUT).reshape(IN, OUT)
    return x, x @ target


def test_parse_gossip() -> None:
    assert parse_strategy("gossip:ring") == StrategySpec("gossip", topology="ring")
    assert parse_strategy(" Gossip : Torus ") == StrategySpec("gossip", topology="torus")
    assert parse_strategy("gossip:Graphs/Edges.txt") == StrategySpec("gossip", topology="Graphs/Edges.txt")
    assert not parse_strategy("gossip:ring").uses_servers
    for bad in ("gossip", "gossip:", "gossipy:ring"):
        with pytest.raises(ConfigError, match="gossip needs its graph"):
            parse_strategy(bad)


def test_gossip_reaches_consensus_and_loss_falls() -> None:
    def worker(ctx: Context) -> tuple[list[float], list[float]]:
        model = make_model(seed=ctx.rank)  # different starts: only gossip can bring them together
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy="gossip:ring", context=ctx
        )
        assert [peer for peer, _ in opt._strategy.neighbors] == sorted({(ctx.rank - 1) % 4, (ctx.rank + 1) % 4})  # type: ignore[attr-defined]
        distances, losses = [], []
        for step in range(STEPS):
            x, y = batch(ctx.rank, step)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            params = flat(model)
            mean = ctx.allreduce(params, op="mean")  # only to measure: the strategy itself never allreduces
            distances.append(float(ctx.allreduce((params - mean).pow(2).sum().reshape(1), op="sum")[0]))
            losses.append(float(ctx.allreduce(loss.detach().reshape(1), op="mean")[0]))
        opt.close()
        return distances, losses

    results = run_ranks(WORKERS, worker)
    distances, losses = results[0]
    assert all(r == results[0] for r in results)  # the measured quantities are global
    assert distances[-1] < 1e-3 * distances[0]  # consensus: the workers' parameters converge to each other
    # while the workers are far apart mixing dominates and the squared distance falls by about (1 - gap)^2 = 1/9
    # per step (ring of 4); from the third step on the workers' different gradients are of the same order
    assert all(b <= 0.15 * a for a, b in itertools.pairwise(distances[:3]))
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5  # and they learn


def reference_dpsgd(topology: str, steps: int) -> list[torch.Tensor]:
    """D-PSGD simulated in one process: ``x_i <- sum_j W_ij x_j + (local momentum-SGD step of x_i)``."""
    from paratrain.gossip.mixing import resolve_mixing

    w = torch.from_numpy(resolve_mixing(topology, WORKERS)[0])
    models = [make_model(seed=r) for r in range(WORKERS)]
    sgds = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    for step in range(steps):
        before = torch.stack([flat(m).double() for m in models])
        for r, (m, sgd) in enumerate(zip(models, sgds, strict=True)):
            x, y = batch(r, step)
            sgd.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            sgd.step()
        after = torch.stack([flat(m).double() for m in models])
        new = (after + w @ before - before).float()
        for m, row in zip(models, new, strict=True):
            torch.nn.utils.vector_to_parameters(row, m.parameters())
    return [flat(m) for m in models]


@pytest.mark.parametrize(
    ("topology", "transport", "overlap"),
    [
        ("ring", "inproc", True),
        ("complete", "inproc", True),
        ("ring", "zmq", True),  # one host: the parameters travel through a shared-memory segment
        ("ring", "sockets", True),  # the same over ZeroMQ messages
        ("given", "inproc", True),
        ("ring", "inproc", False),  # the exchange posted in step(): the same update
    ],
)
def test_gossip_equals_single_process_dpsgd(
    topology: str, transport: str, overlap: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 5
    if transport == "sockets":
        monkeypatch.setattr(Context, "workers_share_memory", lambda self: False)
    if topology == "given":  # a user's W (as `paratrain topology --json` writes it): a lazy path 0-1-2-3
        w = [[0.7, 0.3, 0, 0], [0.3, 0.4, 0.3, 0], [0, 0.3, 0.4, 0.3], [0, 0, 0.3, 0.7]]
        topology = str(tmp_path / "w.json")
        Path(topology).write_text(json.dumps({"mixing_matrix": w}))

    def worker(ctx: Context) -> torch.Tensor:
        model = make_model(seed=ctx.rank)
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
            model=model,
            strategy=f"gossip:{topology}",
            bucket_bytes=64,  # several buckets in one message
            context=ctx,
            overlap=overlap,
        )
        assert len(opt.plan) > 1
        assert opt._strategy.exchange.shared_memory == (transport == "zmq")  # type: ignore[attr-defined]
        for step in range(steps):
            x, y = batch(ctx.rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == 2:  # another collective between steps, while the next exchange is in flight
                ctx.barrier()
                pending = opt._strategy.exchange.receives  # type: ignore[attr-defined]
                if not overlap:
                    assert pending == []  # nothing leaves before the next step()
                elif transport == "inproc":  # inproc delivers at once: the next step's parameters have all arrived
                    assert len(pending) == len(opt._strategy.neighbors) > 0  # type: ignore[attr-defined]
                    assert all(handle.done() for _, _, handle in pending)
        opt.close()
        return flat(model)

    expected = reference_dpsgd(topology, steps)
    got = run_ranks(WORKERS, worker, transport="zmq" if transport == "sockets" else transport)
    for rank in range(WORKERS):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-5)


def test_gossip_with_a_graph_file_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "edges.txt"
    path.write_text("0 1\n1 2\n")  # a path graph over 3 ranks

    def worker(ctx: Context) -> list[int]:
        model = make_model(seed=ctx.rank)
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        opt = ptt.DistributedOptimizer(sgd, model=model, strategy=f"gossip:{path}", context=ctx)
        peers = [peer for peer, _ in opt._strategy.neighbors]  # type: ignore[attr-defined]
        x, y = batch(ctx.rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.close()
        with pytest.raises(ConfigError, match="neither one of ring"):
            ptt.DistributedOptimizer(sgd, model=model, strategy="gossip:star", context=ctx)
        return peers

    assert run_ranks(3, worker) == [[1], [0, 2], [1]]

    class Graph:  # what paratrain reads of a networkx graph
        def edges(self) -> list[tuple[int, int]]:
            return [(0, 1), (1, 2)]

    def objects(ctx: Context) -> list[list[int]]:
        model = make_model(seed=ctx.rank)
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        peers = []
        for graph in (Graph(), [(0, 2), (2, 1)]):
            opt = ptt.DistributedOptimizer(sgd, model=model, strategy="gossip", topology=graph, context=ctx)
            peers.append([peer for peer, _ in opt._strategy.neighbors])  # type: ignore[attr-defined]
            x, y = batch(ctx.rank, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.close()
        with pytest.raises(ConfigError, match="use strategy='gossip' with it"):
            ptt.DistributedOptimizer(sgd, model=model, strategy="allreduce", topology=[(0, 1)], context=ctx)
        return peers

    assert run_ranks(3, objects) == [[[1], [2]], [[0, 2], [2]], [[1], [0, 1]]]

    def too_many(ctx: Context) -> None:
        model = make_model(seed=0)
        ptt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy=f"gossip:{path}", context=ctx
        )

    with pytest.raises(ConfigError, match="not connected"):
        run_ranks(4, too_many)


def test_single_worker_gossip_is_plain_sgd() -> None:
    def worker(ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        model, plain = make_model(seed=3), make_model(seed=3)
        opt = ptt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), model=model, strategy="gossip:ring", context=ctx
        )
        sgd = torch.optim.SGD(plain.parameters(), lr=LR)
        for step in range(3):
            x, y = batch(0, step)
            for m, o in ((model, opt), (plain, sgd)):
                o.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
        opt.close()
        return flat(model), flat(plain)

    [(got, expected)] = run_ranks(1, worker)
    assert torch.equal(got, expected)
