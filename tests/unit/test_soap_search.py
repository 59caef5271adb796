"""The search over per-layer configurations (FlexFlow's): the space, the enumeration where it is small, the
Markov chain where it is not (from data parallelism, within its budget), and ``paratrain plan --search soap``."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from paratrain.cli.main import main
from paratrain.errors import ConfigError
from paratrain.sim.machine import LayerCost, LinkCost, MachineProfile, ModelProfile
from paratrain.sim.soap_search import SoapPoint, search_soap, split_options, splittable
from paratrain.soap import LayerShape, SoapConfig


def _chain(widths: list[int], batch: int = 64) -> ModelProfile:
    """Flatten, then linear layers of ``widths`` with a ReLU between each two, as ``paratrain profile`` records."""
    layers = []
    for i, (n, m) in enumerate(itertools.pairwise(widths)):
        at = 1 + 2 * i
        layers.append(LayerCost(str(at), 1e-6 * n * m / 512, 2e-6 * n * m / 512, (f"{at}.weight", f"{at}.bias"),
                                (4 * n * m, 4 * m), 4 * batch * m, m, n, at))  # fmt: skip
    return ModelProfile("chain", batch, tuple(layers), optimizer_s=1e-3, concurrency=4, modules=2 * len(layers),
                        input_bytes=4 * batch * widths[0])  # fmt: skip


def test_the_space_splits_only_what_divides_and_never_a_group_that_splits_nothing() -> None:
    assert split_options({"1": LayerShape(6, 9)}, 3) == {"1": ("replicated", "column", "row")}
    assert split_options({"1": LayerShape(6, 9)}, 2) == {"1": ("replicated", "row")}
    found = search_soap(lambda p: 1.0 + p.tensor, _chain([64, 512, 10]), 4, budget_s=5)
    # T = 1: one point; T = 2: layer 1 (64 -> 512) and layer 3 (512 -> 10) 3 ways each, less all-replicated; T = 4:
    # layer 3's 10 outputs do not divide, so it is replicated or row-split
    assert found.exhaustive and found.size == found.proposals == 1 + (3 * 3 - 1) + (3 * 2 - 1)
    assert found.best == SoapPoint(1) and found.start_s == 2.0


def test_the_enumeration_finds_the_cheapest_point() -> None:
    model = _chain([64, 512, 512, 10])
    target = SoapPoint(2, (("1", "column"), ("3", "row")))
    found = search_soap(lambda p: 0.5 if p == target else 1.0 + len(p.splits), model, 4, budget_s=5)
    assert found.exhaustive and found.best == target and found.best_s == 0.5 and found.start_s == 1.0


def test_the_chain_starts_from_data_parallelism_and_keeps_to_its_budget() -> None:
    model = _chain([256] * 10)  # 9 layers: 3^9 points per degree, too many to enumerate
    seen: list[SoapPoint] = []

    def cost(point: SoapPoint) -> float:  # fewer replicated layers and a larger degree: faster
        seen.append(point)
        return 1.0 / (1 + len(point.splits)) + 0.01 / point.tensor

    found = search_soap(cost, model, 8, budget_s=0, proposals=400, seed=3)
    assert not found.exhaustive and found.size > 512 and found.proposals == 400 == len(seen)
    assert seen[0] == SoapPoint(1) and found.start_s == cost(SoapPoint(1))
    assert len(found.best.splits) >= 7 and found.best_s < found.start_s / 5  # it climbs: each split helps
    assert found.history == sorted(found.history, reverse=True)  # the best so far never worsens
    again = search_soap(cost, model, 8, budget_s=0, proposals=400, seed=3)
    assert again.best == found.best  # a seed gives the same chain


def test_a_profile_without_layers_that_split_or_a_budget_is_refused() -> None:
    empty = ModelProfile("m", 64, (LayerCost("emb", 0.001, 0.001, module=0),), modules=1)
    with pytest.raises(ConfigError, match="no layer that splits"):
        search_soap(lambda p: 1.0, empty, 2, budget_s=1)
    with pytest.raises(ConfigError, match="give the search a budget"):
        search_soap(lambda p: 1.0, _chain([8, 8]), 2, budget_s=0)
    assert splittable(_chain([8, 4, 2])) == {"1": LayerShape(8, 4), "3": LayerShape(4, 2)}


def test_plan_search_soap_prints_the_pick_per_layer_and_writes_a_configuration_train_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _chain([784, 2048, 2048, 10])
    paths = {"ipc": LinkCost(300e-6, 0.3e-9), "shm": LinkCost(10e-6, 0.1e-9), "tcp": LinkCost(350e-6, 3e-9)}
    machine = MachineProfile("test", paths, gamma=1e-10, copy=5e-11).with_model(
        dataclasses.replace(model, model="widemlp")
    )
    machine.save(tmp_path / "m.json")
    out = tmp_path / "pick.json"
    code = main(["plan", "--machine", str(tmp_path / "m.json"), "--model", "widemlp", "--workers", "4",
                 "--bandwidth", "100Mbit", "--search", "soap", "--budget", "20s", "--soap-out", str(out),
                 "--json", str(tmp_path / "r.json")])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and "| 3 | 2048 -> 2048 |" in text and "the best whole-model strategy" in text
    config = SoapConfig.read(out)
    result = json.loads((tmp_path / "r.json").read_text())
    assert config.tensor == result["pick"]["tensor"] and dict(config.splits or {}) == result["pick"]["splits"]
    assert config.model == "widemlp" and config.tensor * (config.data or 0) == 4
    assert result["pick"]["step_s"] <= result["data_parallel_s"] and result["exhaustive"]
    assert f"--strategy soap:{out} --batch-size {64 * config.tensor}" in text
