"""Pure planning of the PyTorch front end: bucket plans and launch order against exact tables; strategy names."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from paratrain.errors import ConfigError  # noqa: E402
from paratrain.fusion.buckets import Bucket, LaunchOrder, ParamInfo, plan_buckets  # noqa: E402
from paratrain.torch.strategies import StrategySpec, parse_strategy, server_optimizer_spec  # noqa: E402

F32 = "torch.float32@cpu"
F64 = "torch.float64@cpu"


def infos(numels: list[int], kinds: list[str] | None = None) -> list[ParamInfo]:
    kinds = kinds or [F32] * len(numels)
    return [ParamInfo(n, 8 if k == F64 else 4, k) for n, k in zip(numels, kinds, strict=True)]


def table(buckets: list[Bucket]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    return [(b.params, b.offsets, b.numel) for b in buckets]


@pytest.mark.parametrize(
    ("numels", "bucket_bytes", "expected"),
    [
        # four 16-byte params: two per 32-byte bucket, last-registered first
        ([4, 4, 4, 4], 32, [((3, 2), (0, 4), 8), ((1, 0), (0, 4), 8)]),
        # tiny buckets: one parameter each (a parameter larger than the threshold is alone)
        ([4, 4, 4, 4], 1, [((3,), (0,), 4), ((2,), (0,), 4), ((1,), (0,), 4), ((0,), (0,), 4)]),
        # one big bucket
        ([4, 4, 4, 4], 1 << 20, [((3, 2, 1, 0), (0, 4, 8, 12), 16)]),
        # exactly full buckets are allowed
        ([2, 2, 2], 16, [((2, 1), (0, 2), 4), ((0,), (0,), 2)]),
        # uneven sizes: 4+20 bytes fit, 120 alone, then 8+40
        ([10, 2, 30, 5, 1], 64, [((4, 3), (0, 1), 6), ((2,), (0,), 30), ((1, 0), (0, 2), 12)]),
        # empty parameters ride along
        ([0, 3, 0], 12, [((2, 1, 0), (0, 0, 3), 3)]),
        ([], 64, []),
    ],
)
def test_plan_tables(numels: list[int], bucket_bytes: int, expected: list[tuple[object, ...]]) -> None:
    buckets = plan_buckets(infos(numels), bucket_bytes)
    assert table(buckets) == expected
    assert all(b.kind == F32 for b in buckets)


def test_plan_never_mixes_kinds_and_numbers_buckets_by_opening() -> None:
    # p0 f32, p1 f64, p2 f32, p3 f64, p4 f32, 4 elements each; 32-byte buckets hold two f32 or one f64
    ps = infos([4] * 5, [F32, F64, F32, F64, F32])
    buckets = plan_buckets(ps, 32)
    assert [(b.params, b.kind) for b in buckets] == [((4, 2), F32), ((3,), F64), ((1,), F64), ((0,), F32)]


def test_plan_covers_every_parameter_once() -> None:
    numels = [7, 1, 300, 2, 2, 50, 9, 1000, 3]
    for bucket_bytes in (1, 10, 40, 1200, 4000, 1 << 30):
        buckets = plan_buckets(infos(numels), bucket_bytes)
        flat = [i for b in buckets for i in b.params]
        assert sorted(flat) == list(range(len(numels)))
        for b in buckets:
            assert b.numel == sum(numels[i] for i in b.params)
            assert len(b.params) == 1 or b.numel * 4 <= bucket_bytes


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4MB"])
def test_plan_rejects_bad_threshold(bad: object) -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(infos([1]), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ready", "launches"),
    [
        # backward order (last layer first): each bucket leaves as soon as it completes
        ([3, 2, 1, 0], [[], [0], [], [1]]),
        # forward order: bucket 1 completes first but must wait for bucket 0
        ([0, 1, 2, 3], [[], [], [], [0, 1]]),
        # interleaved
        ([2, 0, 3, 1], [[], [], [0], [1]]),
    ],
)
def test_launch_order_is_plan_order(ready: list[int], launches: list[list[int]]) -> None:
    order = LaunchOrder([(3, 2), (1, 0)])
    assert [order.ready(p) for p in ready] == launches
    assert order.complete and order.rest() == []


def test_launch_order_rest_and_reset() -> None:
    order = LaunchOrder([(3, 2), (1, 0), (4,)])
    assert order.ready(4) == []  # bucket 2 is complete, buckets 0 and 1 are not
    assert order.ready(3) == []
    assert order.launched == 0
    assert order.rest() == [0, 1, 2]  # parameter 2, 1, 0 got no gradient: step() starts the rest in order
    with pytest.raises(ValueError, match="twice"):
        order.ready(2)  # its bucket already left
    order.reset()
    assert (order.launched, order.is_ready(3)) == (0, False)
    assert order.ready(3) == [] and order.ready(2) == [0]
    with pytest.raises(ValueError, match="twice"):
        order.ready(3)


def test_launch_order_rejects_overlapping_buckets() -> None:
    with pytest.raises(ValueError, match="in buckets 0 and 1"):
        LaunchOrder([(0, 1), (1,)])


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("allreduce", StrategySpec("allreduce")),
        ("BSP", StrategySpec("bsp")),
        (" asp ", StrategySpec("asp")),
        ("ssp:0", StrategySpec("ssp", 0)),
        ("ssp: 3", StrategySpec("ssp", 3)),
    ],
)
def test_parse_strategy(name: str, spec: StrategySpec) -> None:
    assert parse_strategy(name) == spec


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("ring", ConfigError, "choose one of 'allreduce', 'bsp', 'ssp:S', 'asp'"),
        ("ssp", ConfigError, "ssp:2"),
        ("ssp:-1", ConfigError, "int >= 0"),
        ("gossip", ConfigError, "gossip needs its graph"),
        (3, ConfigError, "must be a string"),
    ],
)
def test_parse_strategy_errors(name: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_strategy(name)  # type: ignore[arg-type]


def test_server_optimizer_spec_maps_hyperparameters() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    assert server_optimizer_spec(torch.optim.SGD([w], lr=0.5, momentum=0.9, nesterov=True, weight_decay=0.1)) == {
        "name": "sgd",
        "lr": 0.5,
        "momentum": 0.9,
        "weight_decay": 0.1,
        "nesterov": True,
    }
    assert server_optimizer_spec(torch.optim.Adam([w], lr=0.01, betas=(0.8, 0.9), eps=1e-6)) == {
        "name": "adam",
        "lr": 0.01,
        "betas": (0.8, 0.9),
        "eps": 1e-6,
        "weight_decay": 0.0,
    }
    assert server_optimizer_spec(torch.optim.Adagrad([w], lr=0.1, initial_accumulator_value=0.5))["name"] == "adagrad"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda w: torch.optim.AdamW([w]), "AdamW"),
        (lambda w: torch.optim.RMSprop([w]), "RMSprop"),
        (lambda w: torch.optim.SGD([w], lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
        (lambda w: torch.optim.Adam([w], amsgrad=True), "amsgrad"),
        (lambda w: torch.optim.SGD([w], lr=0.1, maximize=True), "maximize"),
    ],
)
def test_server_optimizer_spec_refuses_what_servers_cannot_do(make: object, match: str) -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match=match):
        server_optimizer_spec(make(w))  # type: ignore[operator]


def test_server_optimizer_spec_needs_equal_groups() -> None:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.01}], lr=0.1)
    with pytest.raises(ConfigError, match="param groups 0 and 1"):
        server_optimizer_spec(opt)
