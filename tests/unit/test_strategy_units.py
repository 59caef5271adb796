"""A strategy kind is a unit: registered once with its checks, update rule, torch builder, worker and simulator
composer, and every rule across a strategy's options lives in one place (paratrain.strategy.checks)."""

from __future__ import annotations

import ast
import dataclasses
import types
from pathlib import Path

import pytest

import paratrain
import paratrain.strategy.spec
import paratrain.strategy.wrappers
from paratrain.compression import parse_compression
from paratrain.errors import ConfigError
from paratrain.strategy import (
    StrategyOptions,
    StrategyUnit,
    check_options,
    kinds,
    parse_strategy,
    register_kind,
    register_wrapper,
    resolve,
    wrapper_units,
    wrappers_given,
)


@pytest.mark.parametrize(
    "kind", ["allreduce", "bsp", "ssp", "asp", "gossip", "pipeline", "poseidon", "sfb", "tp", "soap"]
)
def test_every_built_in_kind_has_all_its_parts_and_they_resolve(kind: str) -> None:
    unit = kinds()[kind]
    assert unit.update_rule.strip() and callable(unit.checks)
    assert callable(resolve(unit.builder))
    worker = resolve(unit.worker)
    assert isinstance(worker, types.ModuleType) and callable(worker.main)
    composer = resolve(unit.composer)
    assert callable(composer.predict) and callable(composer.estimate)


@pytest.mark.parametrize(
    ("part", "value"),
    [("builder", ""), ("worker", ""), ("composer", ""), ("update_rule", " "), ("checks", None), ("composer", "a b")],
)
def test_a_kind_missing_a_part_does_not_register(part: str, value: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paratrain.strategy.spec, "_KINDS", dict(kinds()))
    unit = dataclasses.replace(kinds()["allreduce"], kind="test-incomplete", **{part: value})
    with pytest.raises(ValueError, match="registers no"):
        register_kind(unit)
    assert "test-incomplete" not in kinds()


def test_a_complete_unit_registers_and_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paratrain.strategy.spec, "_KINDS", dict(kinds()))  # the test's kind leaves with the test
    base = kinds()["allreduce"]
    register_kind(dataclasses.replace(base, kind="test-complete", syntax="test-complete"))
    unit: StrategyUnit = kinds()["test-complete"]
    assert (unit.builder, unit.composer) == (base.builder, base.composer)


def _options(**given: object) -> StrategyOptions:
    compression = given.pop("compression", None)
    return StrategyOptions(compression=parse_compression(compression) if compression else None, **given)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("strategy", "given", "says"),
    [
        ("gossip:ring", {"compression": "fp16"}, "does not support it"),
        ("pipeline:gpipe", {"compression": "fp16"}, "does not support it"),
        ("bsp", {"compression": "powersgd:2"}, "PowerSGD needs two allreduce rounds"),
        ("bsp", {"compression": "powersgd:2"}, "two aggregation rounds"),
        ("ssp:1", {"compression": "dgc:0.1"}, "servers step the optimizer"),
        ("allreduce", {"compression": "fp16", "max_restarts": 1}, "does not combine with max_restarts="),
        ("allreduce", {"servers": 2}, "is for the parameter-server strategies"),
        ("bsp", {"replicas": 2}, "needs that many distinct servers"),
        ("allreduce", {"replicas": 2}, "for pipelines (R pipelines)"),
        ("tp:2", {"max_restarts": 1}, "does not support it"),
        ("gossip:ring", {"checkpoint": True}, "checkpoints allreduce or poseidon or sfb training"),
        ("poseidon", {"checkpoint": True}, "use poseidon:allreduce or sfb"),
        ("poseidon", {"max_restarts": 1}, "use poseidon:allreduce or sfb"),
        ("sfb", {"min_workers": 1, "workers": 2}, "needs the allreduce strategy"),
        ("bsp", {"min_workers": 1, "workers": 2}, "needs the allreduce strategy"),
        ("allreduce", {"min_workers": 3, "workers": 2}, "1..2"),
        ("asp", {"reliable": True}, "reliable= recovers synchronous allreduce or poseidon or sfb training"),
        ("allreduce", {"reliable": True, "overlap": False}, "reliable steps never overlap backward"),
        ("allreduce", {"staleness_lr": True}, "scales stale gradients on the parameter servers"),
        ("allreduce", {"layer_schemes": True}, "are for poseidon"),
        ("pipeline:1f1b", {"device": "cuda"}, "Pipe(device=...)"),
        ("pipeline:1f1b", {"overlap": False}, "a pipeline overlaps by its schedule"),
    ],
)
def test_each_rule_across_options_refuses_with_what_to_do(strategy: str, given: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_options(parse_strategy(strategy), _options(**given))
    assert says in str(info.value)


@pytest.mark.parametrize(
    ("strategy", "given"),
    [
        ("allreduce", {"compression": "powersgd:2", "max_restarts": 0}),
        ("bsp", {"compression": "topk:0.1", "servers": 2, "replicas": 2, "max_restarts": 1}),
        ("poseidon:allreduce", {"compression": "powersgd:2", "layer_schemes": True}),
        ("poseidon", {"servers": 2, "replicas": 2}),
        ("pipeline:gpipe", {"replicas": 2}),
        ("allreduce", {"max_restarts": 2, "min_workers": 1, "workers": 2, "checkpoint": True}),
        ("ssp:2", {"staleness_lr": True}),
        ("gossip:ring", {"max_restarts": 1}),
        ("sfb", {"max_restarts": 1, "checkpoint": True, "reliable": True}),
        ("poseidon:allreduce", {"max_restarts": 1, "checkpoint": True, "layer_schemes": True}),
    ],
)
def test_options_that_go_together_pass(strategy: str, given: dict[str, object]) -> None:
    check_options(parse_strategy(strategy), _options(**given))


def test_the_cli_front_names_its_flags() -> None:
    with pytest.raises(ConfigError, match="--max-restarts restarts the dead workers of allreduce or bsp or ssp or asp"):
        check_options(parse_strategy("tp:2"), StrategyOptions(front="cli", max_restarts=1))


#: The strategy kinds and families, and the names users write: what no module outside paratrain/strategy/
#: compares a strategy with.
_NAMES = {
    *kinds(),
    "collective",
    "parameter-server",
    "decentralised",
    "poseidon:allreduce",
}
_STRATEGY_WORDS = ("strategy", "family")


def _named(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _named(node.func)
    return ""


def _strategy_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare something named like a strategy (or a spec's ``kind``) with a strategy's name."""
    found = []
    for node in ast.walk(tree):
        sides: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and _named(node.func) == "startswith" and isinstance(node.func, ast.Attribute):
            sides = [node.func.value, *node.args]
        names = {_named(n).lower() for s in sides for n in ast.walk(s) if isinstance(n, ast.Name | ast.Attribute)}
        constants = {
            c.value
            for s in sides
            for c in ast.walk(s)
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in _NAMES
        }
        about_strategy = any(word in n for n in names for word in _STRATEGY_WORDS) or "spec" in names
        if constants and about_strategy:
            found.append(node.lineno)
    return found


def test_no_module_outside_the_strategy_package_compares_strategy_names() -> None:
    root = Path(paratrain.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("strategy/"):
            continue
        lines = _strategy_comparisons(ast.parse(path.read_text()))
        if lines:
            found[rel] = lines
    # the example script shows DDP's own path for DDP's own rule, as a user's script would
    assert found == {"examples/ddp_digits.py": [68]}


def test_every_wrapper_has_its_parts_and_decorates_in_registration_order() -> None:
    assert [w.name for w in wrapper_units()] == ["compression", "reliable"]
    for wrapper in wrapper_units():
        assert wrapper.update_rule.strip() and callable(wrapper.checks)
        assert callable(resolve(wrapper.decorator))
    both = StrategyOptions(compression=parse_compression("fp16"), reliable=True)
    assert [w.name for w in wrappers_given(both)] == ["compression", "reliable"]
    assert wrappers_given(StrategyOptions()) == ()


@pytest.mark.parametrize(
    ("part", "value"), [("decorator", ""), ("decorator", "no_colon"), ("update_rule", ""), ("option", "nothing")]
)
def test_a_wrapper_missing_a_part_does_not_register(part: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paratrain.strategy.wrappers, "_WRAPPERS", {w.name: w for w in wrapper_units()})
    unit = dataclasses.replace(wrapper_units()[0], name="test-incomplete", **{part: value})
    with pytest.raises(ValueError, match=r"registers no|no option"):
        register_wrapper(unit)
    assert "test-incomplete" not in [w.name for w in wrapper_units()]
