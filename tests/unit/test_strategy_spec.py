"""Strategy names are parsed in one place, torch-free, into one spec type; kinds come from a registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

import paratrain.strategy.spec
from paratrain.errors import ConfigError
from paratrain.gossip.topology import TOPOLOGIES
from paratrain.strategy import StrategySpec, StrategyUnit, kinds, parse_strategy, register_kind, strategies_help
from paratrain.strategy.spec import GOSSIP_TOPOLOGIES


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("allreduce", ("allreduce", "collective", None, None, False)),
        (" BSP ", ("bsp", "parameter-server", None, None, True)),
        ("ssp:0", ("ssp", "parameter-server", 0, None, True)),
        ("SSP : 12", ("ssp", "parameter-server", 12, None, True)),
        ("asp", ("asp", "parameter-server", None, None, True)),
        ("gossip:Torus", ("gossip", "decentralised", None, "torus", False)),
        ("gossip:graphs/My.edges", ("gossip", "decentralised", None, "graphs/My.edges", False)),
        ("pipeline:1F1B", ("pipeline", "pipeline", None, None, False)),
    ],
)
def test_names_parse_into_one_spec(name: str, expected: tuple[object, ...]) -> None:
    spec = parse_strategy(name)
    assert (spec.kind, spec.family, spec.staleness, spec.topology, spec.uses_servers) == expected
    assert parse_strategy(str(spec)) == spec  # the canonical form parses back


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ssp", "staleness bound"),
        ("ssp:-1", "staleness bound"),
        ("gossip", "needs its graph"),
        ("bsp:2", "takes no argument"),
        ("hogwild", "choose one of 'allreduce', 'bsp', 'ssp:S', 'asp', 'gossip:TOPOLOGY'"),
    ],
)
def test_bad_names_say_what_is_accepted(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_strategy(name)


def test_the_spec_knows_the_ps_consistency_and_the_named_graphs_are_gossips() -> None:
    assert parse_strategy("ssp:3").consistency == "ssp:3"
    assert parse_strategy("allreduce").consistency is None
    assert set(GOSSIP_TOPOLOGIES) == set(TOPOLOGIES)


def test_a_new_kind_registers_without_touching_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paratrain.strategy.spec, "_KINDS", dict(kinds()))  # the test's kind leaves with the test

    def parse(name: str, argument: str | None) -> StrategySpec:
        return StrategySpec(kind="test-pipe", options={"schedule": argument or "1f1b"})

    pipeline = kinds()["pipeline"]
    parts = {
        "update_rule": "a test kind's rule",
        "checks": pipeline.checks,
        "builder": pipeline.builder,
        "worker": pipeline.worker,
        "composer": pipeline.composer,
    }
    register_kind(StrategyUnit("test-pipe", "test-pipe:SCHEDULE", "pipeline", "a test kind", parse, **parts))
    spec = parse_strategy("test-pipe:gpipe")
    assert (spec.family, spec.options["schedule"], spec.uses_servers) == ("pipeline", "gpipe", False)
    assert "test-pipe:SCHEDULE" in strategies_help()
    with pytest.raises(ValueError, match="taken"):
        register_kind(StrategyUnit("bsp", "bsp", "parameter-server", "again", parse, **parts))


def test_parsing_does_not_import_torch() -> None:
    code = "import sys, paratrain.strategy as s; s.parse_strategy('gossip:ring'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
