"""The pure parts of ``paratrain profile``: the Hockney fit (exact on exact data, clamped on noise), the emulated
links' specs and sizes, the layers' nesting and the combination of processes, and the profile's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paratrain.bench.profile_links import DEFAULT_SIZES, _emulated_plan, emulated_spec, fit_hockney
from paratrain.bench.profile_models import _combine, _nested
from paratrain.cli.profile import format_table, parse_sizes
from paratrain.errors import ConfigError
from paratrain.sim.machine import Cluster, LayerCost, LinkCost, MachineProfile, ModelProfile

SIZES = [0, 1 << 10, 64 << 10, 1 << 20, 16 << 20]


@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize(("alpha", "beta"), [(50e-6, 1 / 1e9), (2e-3, 1 / 12.5e6), (1e-6, 0.0)])
def test_fit_is_exact_on_exact_data(alpha: float, beta: float, relative: bool) -> None:
    cost = fit_hockney(SIZES, [alpha + beta * n for n in SIZES], relative=relative)
    assert cost.alpha == pytest.approx(alpha, rel=1e-9)
    assert cost.beta == pytest.approx(beta, rel=1e-9, abs=1e-18)


def test_fit_through_a_zero_time() -> None:
    # a message of 0 bytes measured at 0 s: the relative fit weighs it as 1 ns and still fits exactly
    cost = fit_hockney(SIZES, [n / 1e9 for n in SIZES])
    assert cost.alpha == pytest.approx(0.0, abs=1e-15)
    assert cost.beta == pytest.approx(1e-9, rel=1e-9)


def test_negative_alpha_is_clamped_and_beta_refitted() -> None:
    # absolute least squares of (0,0), (1,1), (2,3): t = -1/6 + 3/2 n; through the origin: beta = 7/5
    cost = fit_hockney([0, 1, 2], [0.0, 1.0, 3.0], relative=False)
    assert (cost.alpha, cost.beta) == (0.0, pytest.approx(7 / 5))
    # relative: (1,1), (2,4) give t = -2 + 3 n; through the origin beta = sum(n/t) / sum(n²/t²) = 1.5 / 1.25
    cost = fit_hockney([1, 2], [1.0, 4.0])
    assert (cost.alpha, cost.beta) == (0.0, pytest.approx(6 / 5))


def test_negative_beta_is_clamped_and_alpha_refitted() -> None:
    # absolute: (0,3), (1,1), (2,0) slope down; the constant that fits best is the mean, 4/3
    cost = fit_hockney([0, 1, 2], [3.0, 1.0, 0.0], relative=False)
    assert (cost.alpha, cost.beta) == (pytest.approx(4 / 3), 0.0)
    # relative: (1,4), (2,1): alpha = sum(1/t) / sum(1/t²) = 1.25 / 1.0625
    cost = fit_hockney([1, 2], [4.0, 1.0])
    assert (cost.alpha, cost.beta) == (pytest.approx(20 / 17), 0.0)


@pytest.mark.parametrize(
    ("sizes", "seconds", "message"),
    [
        ([0, 1], [1.0], "one time per size"),
        ([0, 1024], [1.0, -1.0], ">= 0"),
        ([0, 1024], [1.0, float("nan")], "finite"),
        ([1024, 1024], [1.0, 2.0], "two distinct"),
    ],
)
def test_fit_refuses_what_it_cannot_fit(sizes: list[int], seconds: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_hockney(sizes, seconds)


def test_emulated_specs() -> None:
    assert emulated_spec("100Mbit") == "bandwidth=100Mbit"
    assert emulated_spec("2ms") == "latency=2ms"
    assert emulated_spec("latency=1ms,bandwidth=1Gbit") == "latency=1ms,bandwidth=1Gbit"
    assert emulated_spec(" 1ms , 1Gbit ") == "latency=1ms,bandwidth=1Gbit"
    for bad, message in [("fast", "neither a bandwidth"), ("", "needs a link"), ("drop=0.1", "not faults")]:
        with pytest.raises(ConfigError, match=message):
            emulated_spec(bad)


def test_emulated_link_keeps_sizes_it_carries_in_20ms() -> None:
    sizes, repeats = _emulated_plan("bandwidth=100Mbit", DEFAULT_SIZES, quick=False)
    assert sizes == [0, 1 << 10, 64 << 10]  # 12.5 MB/s x 20 ms = 250 KB
    assert len(repeats) == 3 and all(3 <= r <= 200 for r in repeats)
    assert _emulated_plan("bandwidth=1Gbit", DEFAULT_SIZES, quick=True)[0] == [0, 1 << 10, 64 << 10, 1 << 20]
    assert _emulated_plan("latency=5ms", DEFAULT_SIZES, quick=True)[0] == list(DEFAULT_SIZES)  # no bandwidth limit
    assert _emulated_plan("bandwidth=1Mbit", [1 << 20, 4 << 20, 16 << 20], quick=True)[0] == [1 << 20, 4 << 20]


def test_nested_layers_are_charged_once() -> None:
    assert _nested(["0", "0.token", "1.qkv", "10"]) == {"0": ["0.token"], "0.token": [], "1.qkv": [], "10": []}
    assert _nested(["(root)", "a", "a.b", "a.b.c"]) == {"(root)": ["a"], "a": ["a.b"], "a.b": ["a.b.c"], "a.b.c": []}


def _run(step: float, fwd: float, bwd: float, opt: float) -> dict[str, Any]:
    layer = {"name": "fc", "forward_s": fwd, "backward_s": bwd, "params": ["fc.weight"], "param_bytes": [64]}
    shape = {"output_bytes": 32, "out_features": 4, "in_features": 3}
    return {"layers": [{**layer, **shape}], "optimizer_s": opt, "step_s": step, "threads": 1}


def test_combine_takes_medians_over_processes() -> None:
    profile = _combine("m", 8, [_run(10.0, 1.0, 2.0, 0.5), _run(30.0, 3.0, 6.0, 1.5), _run(20.0, 2.0, 4.0, 1.0)])
    assert profile.concurrency == 3 and profile.batch_size == 8
    assert profile.layers == (LayerCost("fc", 2.0, 4.0, ("fc.weight",), (64,), 32, 4, 3),)
    assert (profile.optimizer_s, profile.overhead_s) == (1.0, 20.0 - 6.0 - 1.0)
    assert _combine("m", 8, [_run(1.0, 1.0, 2.0, 0.5)]).overhead_s == 0.0  # never negative


def test_combine_expects_the_slowest_of_the_processes_steps() -> None:
    runs = [
        dict(_run(10.0, 1.0, 2.0, 0.5), step_samples=[1.0, 2.0]),
        dict(_run(10.0, 1.0, 2.0, 0.5), step_samples=[3.0, 4.0]),
    ]
    # pooled 1, 2, 3, 4: the larger of two draws is 4 w.p. 7/16, 3 w.p. 5/16, 2 w.p. 3/16, 1 w.p. 1/16
    assert _combine("m", 8, runs).straggle_s == pytest.approx((4 * 7 + 3 * 5 + 2 * 3 + 1) / 16 - 2.5)
    assert _combine("m", 8, runs[:1]).straggle_s == 0.0  # one process waits for no one


def _machine() -> MachineProfile:
    layers = (
        LayerCost("0", 1e-3, 2e-3, ("0.position",), (256,), 1024),
        LayerCost("0.token", 5e-4, 1e-3, ("0.token.weight",), (4096,), 1024),
    )
    model = ModelProfile(
        "transformer",
        16,
        layers,
        optimizer_s=1e-4,
        concurrency=2,
        overhead_s=3e-4,
        straggle_s=2e-4,
        alone_s=5e-4,
        input_bytes=4096,
    )
    return MachineProfile(
        "box",
        {
            "ipc": LinkCost(40e-6, 1 / 2e9),
            "injected@2": LinkCost(80e-6, 1 / 1e9, ingress_beta=1e-9),
            "emulated:100Mbit": LinkCost(1e-3, 1 / 12.5e6),
            "shm": LinkCost(5e-6, 0.0),
        },
        gamma=1e-10,
        copy=5e-11,
        cluster=Cluster(hosts=2, ranks_per_host=2, intra="shm", inter="emulated:100Mbit", cores_per_host=2),
        notes="test",
    ).with_model(model)


def test_profile_json_round_trip(tmp_path: Path) -> None:
    machine = _machine()
    assert MachineProfile.from_json(json.loads(json.dumps(machine.to_json()))) == machine
    machine.save(tmp_path / "m.json")
    again = MachineProfile.load(tmp_path / "m.json")
    assert again == machine
    assert again.model("transformer", 16, 2).layers[1].params == ("0.token.weight",)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(format=2), "format 2 is not 1"),
        (lambda d: d.pop("format"), "format None"),
        (lambda d: d.pop("paths"), "malformed"),
        (lambda d: d["paths"]["ipc"].pop("beta"), "malformed"),
        (lambda d: d["paths"]["ipc"].update(alpha=-1.0), ">= 0"),
        (lambda d: next(iter(d["models"].values()))["layers"][0].pop("forward_s"), "malformed"),
        (lambda d: next(iter(d["models"].values()))["layers"][0].update(param_bytes=[]), "1 params but 0 sizes"),
        (lambda d: d["cluster"].update(racks=3), "malformed"),
    ],
)
def test_from_json_refuses_bad_files(change: Any, message: str) -> None:
    data = json.loads(json.dumps(_machine().to_json()))
    change(data)
    with pytest.raises(ConfigError, match=message):
        MachineProfile.from_json(data)


def test_load_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="paratrain profile --out"):
        MachineProfile.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        MachineProfile.load(tmp_path / "bad.json")


def test_cli_sizes_and_table() -> None:
    assert parse_sizes("1MiB, 0, 1KiB, 1MiB") == [0, 1024, 1 << 20]
    for bad in ("1KiB", "0,lots", "0,3"):
        with pytest.raises(ConfigError, match="--sizes"):
            parse_sizes(bad)
    table = format_table(_machine())
    assert "ipc" in table and "2000.0" in table  # MB/s
    assert "unlimited" in table  # shm's beta of 0
    assert "model transformer@16x2" in table and "0.token" in table
