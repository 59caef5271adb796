"""``paratrain train --strategy tp:N|soap:FILE``: a per-layer configuration is checked against the model and the
workers before anything starts, and every refusal says what to change; the file format round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.errors import ConfigError
from paratrain.soap import LayerShape, SoapConfig, SoapConfigError, megatron_splits
from paratrain.train.checks import validate
from paratrain.train.job import TrainJob

pytest.importorskip("torch")


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return f"soap:{path}"


def test_tp_fills_in_one_tensor_group_and_a_file_its_grid(tmp_path: Path) -> None:
    assert validate(TrainJob(strategy="tp:2")).workers == 2
    grid = _file(tmp_path, '{"tensor": 2, "data": 2, "splits": {"1": "column", "3": "row"}}')
    assert validate(TrainJob(strategy=grid)).workers == 4
    assert validate(TrainJob(strategy="tp:2", workers=6, model="lenet")).workers == 6


@pytest.mark.parametrize(
    ("strategy", "flags", "says"),
    [
        ("tp:2", {"workers": 3}, "give --workers a multiple of 2"),
        ("tp:3", {"workers": 3}, "splits no layer of --model mlp"),
        (
            "tp:3",
            {"model": "transformer", "dataset": "fortunes", "workers": 3},
            "splits no layer of --model transformer",
        ),
        (
            '{"tensor": 3, "splits": {"1": "column"}}',
            {"workers": 3},
            "its 512 outputs (features or channels) to divide by 3",
        ),
        ('{"tensor": 2, "splits": {"fc9": "row"}}', {}, "the model has no layer 'fc9' to split"),
        (
            '{"tensor": 2, "splits": {"2": "row"}}',
            {},
            "layer 2 is a ReLU; only linear layers, 2-d convolutions, transformer blocks",
        ),
        ('{"tensor": 2, "splits": {"1": "diagonal"}}', {}, "unknown split 'diagonal'"),
        ('{"tensor": 2, "data": 1, "splits": {"1": "column", "3": "row"}}', {"workers": 4}, "give --workers 2"),
        ('{"tensor": 2, "model": "lenet", "splits": {}}', {}, "made for --model lenet, not mlp"),
        ('{"tensor": 2, "splitz": {}}', {}, "unknown field(s) splitz"),
        ("not json", {}, "is not JSON"),
        ("tp:2", {"compression": "fp16"}, "does not support it"),
        ("tp:2", {"max_restarts": 1}, "does not support it"),
        ("tp:2", {"no_overlap": True}, "moves activations between split layers"),
        ("tp:2", {"replicas": 2}, "for pipelines (R pipelines)"),
        ("tp:2", {"bucket_bytes": 1 << 20}, "--bucket-bytes sizes the data-parallel strategies' gradient buckets"),
        ("tp:0", {}, "tp needs its tensor-parallel degree N >= 1"),
    ],
)
def test_a_bad_configuration_is_refused_with_what_to_change(
    strategy: str, flags: dict[str, object], says: str, tmp_path: Path
) -> None:
    name = strategy if strategy.startswith("tp:") else _file(tmp_path, strategy)
    with pytest.raises(ConfigError) as info:
        validate(TrainJob(strategy=name, **flags))  # type: ignore[arg-type]
    assert says in str(info.value)


def test_a_missing_file_is_named() -> None:
    with pytest.raises(ConfigError, match=r"cannot read the configuration 'nowhere\.json'"):
        validate(TrainJob(strategy="soap:nowhere.json"))


def test_the_file_format_round_trips(tmp_path: Path) -> None:
    config = SoapConfig(2, {"1": "column", "3": "row"}, data=2, model="mlp")
    assert SoapConfig.read(config.write(tmp_path / "c.json")) == config
    assert SoapConfig.from_json(SoapConfig(4).to_json()) == SoapConfig(4)  # Megatron's pairs
    with pytest.raises(SoapConfigError, match="tensor and data degrees must be at least 1"):
        SoapConfig(0)


def test_megatron_pairs_break_at_a_layer_that_does_not_divide() -> None:
    chain = [(str(i), LayerShape(a, b)) for i, (a, b) in enumerate([(8, 9), (9, 6), (6, 4), (4, 3), (3, 8)])]
    # layer 0's 9 outputs do not split in two; layers 1 and 2 pair; layer 3's 3 outputs do not split; layer 4
    # starts a pair that nothing ends
    assert megatron_splits(chain, 2) == {"1": "column", "2": "row"}
