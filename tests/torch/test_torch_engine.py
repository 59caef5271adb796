"""Collectives through torch.distributed's engines (:mod:`paratrain.collectives.torch_engines`), run here with Gloo on
CPU tensors: the path NCCL takes for CUDA tensors, apart from the process group's constructor.

Every collective through the engine equals the same call on paratrain's own algorithms, bit for bit (two ranks:
one addition per element, whatever the order; three ranks: integer-valued data), for every dtype the engines take;
what they do not take (bool, complex) stays on paratrain's paths; ranks that disagree raise the same error; and the
engine choice for CUDA tensors is a pure function checked against an exact table.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import paratrain.torch as ptt  # noqa: E402
from paratrain import Context  # noqa: E402
from paratrain.collectives.torch_engines import DeviceIdentity, TorchEngine, choose_engine  # noqa: E402
from paratrain.errors import CollectiveMismatchError, CommTimeoutError, ConfigError, TransportError  # noqa: E402
from paratrain.testing import run_ranks  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]


def _data(rank: int, dtype: Any, scale: float = 1.0) -> Any:
    gen = torch.Generator().manual_seed(rank)
    if dtype.is_floating_point:
        return (torch.randn(5, 7, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return torch.randint(0, 9, (5, 7), generator=gen).to(dtype)


def _every_collective(ctx: Context, x: Any) -> list[Any]:
    out = [ctx.allreduce(x, op=op) for op in ("sum", "mean", "max", "min")]
    inplace = x.clone()
    assert ctx.allreduce_(inplace, op="mean") is inplace
    strided = x.clone().t()  # not contiguous: reduced through a copy and written back into the view
    ctx.allreduce_(strided)
    handle, buffer = ctx.allreduce_async(x), x.clone()
    out += [inplace, strided, handle.wait(), ctx.allreduce_async_(buffer, op="max").wait()]
    out += [ctx.broadcast(x, root=ctx.world_size - 1), ctx.allgather(x[: ctx.rank + 1]), ctx.allgather_async(x).wait()]
    out += [ctx.reduce_scatter(x), ctx.reduce_scatter(x, op="mean"), ctx.allreduce(x[0, 0]), ctx.allreduce(x[:0])]
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_collective_through_gloo_equals_paratrains_own_bit_for_bit(dtype: Any) -> None:
    def worker(ctx: Context) -> tuple[list[Any], list[Any], int]:
        x = _data(ctx.rank, dtype)
        own = _every_collective(ctx, x)
        engine = ctx.collectives.use_torch_distributed("gloo")
        through = _every_collective(ctx, x)
        return own, through, engine.calls

    for own, through, calls in run_ranks(2, worker, timeout=90):
        assert calls == len(own) - 1  # every call but the empty one went to Gloo
        for mine, theirs in zip(own, through, strict=True):
            assert theirs.dtype == mine.dtype and theirs.shape == mine.shape
            assert torch.equal(theirs, mine), (mine, theirs)


def test_three_ranks_with_integer_valued_floats_agree_with_paratrain() -> None:
    def worker(ctx: Context) -> tuple[list[Any], list[Any]]:
        x = torch.randint(-50, 50, (9, 4), generator=torch.Generator().manual_seed(ctx.rank)).float()
        own = _every_collective(ctx, x)
        ctx.collectives.use_torch_distributed("gloo")
        return own, _every_collective(ctx, x)

    for own, through in run_ranks(3, worker, timeout=90):
        for mine, theirs in zip(own, through, strict=True):
            assert torch.equal(theirs, mine)


def test_what_the_engine_does_not_take_stays_on_paratrains_paths() -> None:
    def worker(ctx: Context) -> tuple[Any, ...]:
        engine = ctx.collectives.use_torch_distributed("gloo")
        flags = ctx.allreduce(torch.tensor([ctx.rank == 0, False]), op="max")
        waves = ctx.allreduce(torch.tensor([1 + 1j]) * (ctx.rank + 1))
        arr = ctx.allreduce(np.arange(3.0))  # numpy arrays: paratrain's algorithms
        ring = ctx.allreduce(torch.ones(4), algorithm="ring")  # a named paratrain algorithm
        return engine.calls, flags.tolist(), waves.tolist(), arr.tolist(), ring.tolist()

    for result in run_ranks(2, worker, timeout=60):
        assert result == (0, [True, False], [(3 + 3j)], [0.0, 2.0, 4.0], [2.0] * 4)


def test_ranks_that_disagree_raise_the_same_error_and_stay_usable() -> None:
    def worker(ctx: Context) -> tuple[str, str, list[float]]:
        ctx.collectives.use_torch_distributed("gloo")
        x: Any = torch.ones(3) if ctx.rank == 0 else np.ones(3, np.float32)  # the engine on rank 0, the ring on rank 1
        with pytest.raises(CollectiveMismatchError) as first:
            ctx.allreduce(x)
        with pytest.raises(CollectiveMismatchError) as second:
            ctx.allreduce(torch.ones(3 + ctx.rank))
        return str(first.value), str(second.value), ctx.allreduce(torch.ones(2)).tolist()

    results = run_ranks(2, worker, timeout=60)
    assert results[0] == results[1]
    assert "gloo" in results[0][0] and results[0][2] == [2.0, 2.0]


def test_ranks_asking_for_different_engines_get_the_same_config_error() -> None:
    def worker(ctx: Context) -> str:
        with pytest.raises(ConfigError) as info:
            ctx.collectives.use_torch_distributed("gloo", "cpu" if ctx.rank == 0 else "cuda")
        with pytest.raises(ConfigError, match="NCCL: 'cuda'"):
            ctx.collectives.use_torch_distributed("nccl", "cpu")
        assert ctx.allreduce(torch.ones(1)).tolist() == [2.0]  # no engine was installed: still usable
        assert not ctx.collectives.engines
        return str(info.value)

    first, second = run_ranks(2, worker, timeout=60)
    assert first == second and "different torch.distributed engines" in first


def test_the_distributed_optimizer_over_gloo_equals_it_over_paratrain() -> None:
    """The allreduce strategy's fused buckets (CPU tensors) go through Gloo; parameters equal bit for bit."""
    gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(4, 2, 8, 6, generator=gen), torch.randn(4, 2, 8, 3, generator=gen)

    def train(engine: bool) -> list[Any]:
        def worker(ctx: Context) -> tuple[list[Any], int]:
            if engine:
                ctx.collectives.use_torch_distributed("gloo")
            net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            init = torch.Generator().manual_seed(0)  # not the global RNG: the thread ranks share it
            with torch.no_grad():
                for p in net.parameters():
                    p.copy_(torch.randn(p.shape, generator=init) * 0.3)
            opt = ptt.DistributedOptimizer(
                torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                model=net,
                strategy="allreduce",
                bucket_bytes=256,
                context=ctx,
            )
            for step in range(4):
                opt.zero_grad()
                torch.nn.functional.mse_loss(net(xs[step, ctx.rank]), ys[step, ctx.rank]).backward()
                opt.step()
            calls = ctx.collectives.engines["cpu"].calls if engine else 0
            return [p.detach().clone() for p in net.parameters()], calls

        results = run_ranks(2, worker, timeout=90)
        assert (results[0][1] > 0) == engine
        return results[0][0]

    for own, through in zip(train(False), train(True), strict=True):
        assert torch.equal(own, through)


# -- the engine's failures, with a process group that fails on purpose


class _FailingWork:
    def __init__(self, text: str) -> None:
        self.text = text

    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError(self.text)


class _FailingGroup:
    def __init__(self, text: str) -> None:
        self.text = text

    def allreduce(self, tensors: Any, options: Any) -> _FailingWork:
        return _FailingWork(self.text)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[Gloo] Timed out waiting 1000ms for recv operation", CommTimeoutError),
        ("Connection closed by peer", TransportError),
    ],
)
def test_a_failure_inside_the_engine_is_a_paratrain_error_and_breaks_it(text: str, error: type[Exception]) -> None:
    engine = TorchEngine("gloo", "cpu", _FailingGroup(text), None, rank=0, world_size=2)
    with pytest.raises(error, match="gloo allreduce"):
        engine.allreduce_(torch.ones(2), "sum", 1.0)
    with pytest.raises(TransportError, match="failed earlier"):
        engine.allreduce_(torch.ones(2), "sum", 1.0)


# -- which engine CUDA tensors get


def _ids(devices: str, nccl: str = "", preference: str = "auto") -> list[DeviceIdentity]:
    return [DeviceIdentity(d, r not in nccl, preference) for r, d in zip("0123", devices, strict=False)]


@pytest.mark.parametrize(
    ("identities", "backend", "reason"),
    [
        (_ids("ab"), "nccl", "every one of 2 rank(s) has a GPU of its own and NCCL"),
        (_ids("a"), "nccl", "every one of 1 rank(s) has a GPU of its own and NCCL"),
        (
            _ids("abca"),
            None,
            "staging through pinned host memory: ranks 0 and 3 share GPU a (NCCL needs one GPU per rank)",
        ),
        (_ids("ab", nccl="1"), None, "staging through pinned host memory: torch.distributed has no NCCL on rank(s) 1"),
        (_ids("aa", preference="staged"), None, "PARATRAIN_CUDA_COLLECTIVES=staged"),
        (_ids("ab", preference="staged"), None, "PARATRAIN_CUDA_COLLECTIVES=staged"),
        (_ids("aa", nccl="01", preference="gloo"), "gloo", "PARATRAIN_CUDA_COLLECTIVES=gloo"),
        (_ids("ab", preference="nccl"), "nccl", "every one of 2 rank(s) has a GPU of its own and NCCL"),
    ],
)
def test_the_cuda_engine_choice_table(identities: list[DeviceIdentity], backend: str | None, reason: str) -> None:
    choice = choose_engine(identities)
    assert (choice.backend, choice.reason) == (backend, reason)


@pytest.mark.parametrize(
    ("identities", "message"),
    [
        (_ids("aa", preference="nccl"), "ranks 0 and 1 share GPU a"),
        (_ids("ab", nccl="0", preference="nccl"), r"no NCCL on rank\(s\) 0"),
        (_ids("ab", preference="fast"), "choose one of auto, nccl, gloo, staged"),
        ([*_ids("a"), *_ids("b", preference="staged")], "set it alike on every rank"),
    ],
)
def test_impossible_cuda_engine_requests_are_config_errors(identities: list[DeviceIdentity], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        choose_engine(identities)


def test_device_identities_travel_as_json_and_malformed_ones_are_refused() -> None:
    mine = DeviceIdentity("GPU-8c1d", True, "auto")
    assert DeviceIdentity.decode(mine.encode()) == mine
    with pytest.raises(ValueError, match="malformed"):
        DeviceIdentity.decode(np.frombuffer(b'{"device": 3}'.ljust(256, b"\0"), dtype=np.uint8))


def test_the_engine_choice_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """The choice's log line is written by rank 0 only; without a GPU it is checked on the table above."""
    caplog.set_level(logging.INFO, logger="paratrain.collectives")

    def worker(ctx: Context) -> None:
        ctx.collectives.use_torch_distributed("gloo")

    run_ranks(2, worker, timeout=60)
    assert sum("gloo process group of 2 rank(s) for cpu tensors" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.parametrize(
    ("preference", "backend", "logged"),
    [
        ("gloo", "gloo", "collectives on CUDA tensors: gloo (PARATRAIN_CUDA_COLLECTIVES=gloo)"),
        (
            "auto",
            None,
            "collectives on CUDA tensors: staged (staging through pinned host memory: ranks 0 and 1 share "
            "GPU GPU-shared (NCCL needs one GPU per rank))",
        ),
        ("staged", None, "collectives on CUDA tensors: staged (PARATRAIN_CUDA_COLLECTIVES=staged)"),
    ],
)
def test_the_cuda_choice_is_made_once_by_every_rank_and_logged(
    preference: str, backend: str | None, logged: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The choice's own code on the CPU: the GPU's name stubbed (two thread ranks "share" one GPU), every rank
    deciding alike, the decision cached, the engine opened for CUDA tensors (Gloo's process group needs no GPU to
    open), and rank 0's log line. NCCL is said to be there, so that ``auto`` stages because the GPU is shared."""
    monkeypatch.setattr("paratrain.collectives.routing.gpu_name", lambda device, host=None: "GPU-shared")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setenv("PARATRAIN_CUDA_COLLECTIVES", preference)
    caplog.set_level(logging.INFO, logger="paratrain.collectives")

    def worker(ctx: Context) -> tuple[str | None, bool]:
        engine = ctx.collectives.device_engine(torch.device("cuda", 0))
        again = ctx.collectives.device_engine(torch.device("cuda", 0))  # decided: no second exchange
        assert ctx.allreduce(torch.ones(1)).tolist() == [2.0]  # the ranks' tags are still in step
        return (engine.name if engine is not None else None), again is engine

    assert run_ranks(2, worker, timeout=60) == [(backend, True)] * 2
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("collectives on CUDA tensors")]
    assert lines == [logged]


def test_insisting_on_nccl_where_it_cannot_run_fails_every_rank_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("paratrain.collectives.routing.gpu_name", lambda device, host=None: "GPU-shared")
    monkeypatch.setenv("PARATRAIN_CUDA_COLLECTIVES", "nccl")

    def worker(ctx: Context) -> list[str]:
        messages = []
        for _ in range(2):
            with pytest.raises(ConfigError) as info:
                ctx.collectives.device_engine(torch.device("cuda", 0))
            messages.append(str(info.value))
        assert ctx.allreduce(torch.ones(1)).tolist() == [2.0]
        return messages

    first, second = run_ranks(2, worker, timeout=60)
    assert first == second and first[0] == first[1] and "PARATRAIN_CUDA_COLLECTIVES=nccl, but" in first[0]


@pytest.mark.parametrize(
    ("devices", "preference", "backend"),
    [
        (["GPU-a", "GPU-b"], "auto", "nccl"),
        (["cpu:0", "GPU-b"], "auto", None),
        (["GPU-a", "GPU-a"], "auto", None),
        (["cpu:0", "cpu:1"], "gloo", "gloo"),
        (["GPU-a", "GPU-b"], "staged", None),
    ],
)
def test_how_pipeline_stages_are_linked(devices: list[str], preference: str, backend: str | None) -> None:
    from paratrain.collectives.torch_engines import choose_link

    ids = [DeviceIdentity(d, not d.startswith("cpu:"), preference) for d in devices]
    assert choose_link(ids).backend == backend


@pytest.mark.parametrize(
    ("devices", "preference", "message"),
    [(["cpu:0", "GPU-b"], "gloo", "sends CPU tensors only"), (["cpu:0", "GPU-b"], "nccl", "no NCCL on rank")],
)
def test_impossible_pipeline_links_are_config_errors(devices: list[str], preference: str, message: str) -> None:
    from paratrain.collectives.torch_engines import choose_link

    ids = [DeviceIdentity(d, not d.startswith("cpu:"), preference) for d in devices]
    with pytest.raises(ConfigError, match=message):
        choose_link(ids)
