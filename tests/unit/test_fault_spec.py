"""Tests of the fault-injection spec strings (``PARATRAIN_FAULTS``); the injector itself is tested elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.errors import ConfigError
from paratrain.transport.faults import FaultSpec, Link, parse_bandwidth, read_links


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("100Mbit", 12.5e6),  # bits: divided by 8
        ("1Gbit", 1.25e8),
        ("50MB", 50e6),  # capital B: bytes
        ("8kbit", 1000.0),
        (" 2.5 GB ", 2.5e9),
    ],
)
def test_parse_bandwidth(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["fast", "0Mbit", "", "-5MB", "10Tbit"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_bandwidth(text)


def test_fault_spec_parse_all_fields() -> None:
    spec = FaultSpec.parse("latency=2ms,bandwidth=100Mbit,drop=0.01,seed=7,crash_after=100")
    assert spec.latency == pytest.approx(0.002)
    assert spec.bandwidth == pytest.approx(12.5e6)
    assert spec.drop == pytest.approx(0.01)
    assert spec.seed == 7
    assert spec.crash_after == 100


def test_fault_spec_parse_tolerates_spaces_and_empty_items() -> None:
    assert FaultSpec.parse(" latency = 1s , ,drop=0.5,") == FaultSpec(latency=1.0, drop=0.5)


@pytest.mark.parametrize("text", ["", " ", ","])
def test_fault_spec_parse_empty_gives_defaults(text: str) -> None:
    spec = FaultSpec.parse(text)
    assert spec == FaultSpec()
    assert (spec.latency, spec.bandwidth, spec.drop, spec.seed, spec.crash_after) == (0.0, None, 0.0, 0, None)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("latency", "key=value"),
        # An unknown key must list the known ones so the user can fix a typo.
        ("colour=red", r"colour.*latency, bandwidth, drop, seed, crash_after"),
        ("drop=1.5", "drop"),
        ("drop=x", "drop=x"),
        ("crash_after=-1", "crash_after"),
        ("latency=-2ms", "-2ms"),
        ("bandwidth=fast", "fast"),
        ("seed=1.5", "seed"),
    ],
)
def test_fault_spec_parse_rejects(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FaultSpec.parse(text)


def test_links_file_gives_pairs_their_own_links(tmp_path: Path) -> None:
    path = tmp_path / "links.json"
    path.write_text(
        json.dumps({"links": [{"between": [0, 1], "bandwidth": "100Mbit", "latency": "2ms"}, {"between": [2, 1]}]})
    )
    spec = FaultSpec.parse(f"latency=1ms,links={path}")
    assert spec.latency == pytest.approx(0.001)
    assert spec.links == (Link(0, 1, 12.5e6, 0.002), Link(2, 1, None, 0.0))
    assert read_links(str(path)) == spec.links


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"link": []}, "expected"),
        ({"links": [{"between": [0]}]}, "'between' must be two ranks"),
        ({"links": [{"between": [1, 1]}]}, "two different ranks"),
        ({"links": [{"between": [0, 1]}, {"between": [1, 0]}]}, "listed twice"),
        ({"links": [{"between": [0, 1], "bandwidth": "fast"}]}, "entry 0"),
        ({"links": [{"between": [0, 1], "bandwidth": 0}]}, "must be positive"),
    ],
)
def test_links_file_errors_say_which_entry_and_why(tmp_path: Path, doc: object, message: str) -> None:
    path = tmp_path / "links.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message):
        FaultSpec.parse(f"links={path}")
    with pytest.raises(ConfigError, match="links file"):
        FaultSpec.parse(f"links={tmp_path / 'missing.json'}")
