"""`paratrain bench soap`: Megatron's pairs, the loss check, argument checks, and one tiny run end to end with
torch's parallelize_module beside paratrain (no timing asserted: the machine decides those)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from torch import nn

from paratrain.bench._soap_worker import megatron_pairs
from paratrain.bench.harness import EngineRun
from paratrain.bench.soap import SoapBenchOptions, _verified
from paratrain.errors import ConfigError

CLI = [sys.executable, "-m", "paratrain.cli.main", "bench", "soap"]


def test_megatron_pairs_split_consecutive_linear_layers_and_skip_what_does_not_divide() -> None:
    chain = nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 10))  # fmt: skip
    assert megatron_pairs(chain, 2) == {"1": "column", "3": "row"}
    odd = nn.Sequential(nn.Linear(8, 9), nn.Linear(9, 6), nn.Linear(6, 4), nn.Linear(4, 2))
    # 9 outputs do not split in two: the first pair is layers 1 and 2; layer 3 starts a pair nothing ends
    assert megatron_pairs(odd, 2) == {"1": "column", "2": "row"}


def test_an_engine_whose_losses_are_not_one_process_s_is_failed() -> None:
    ok = EngineRun("ok", "", [{"rank": 0, "losses": [2.30001, 2.2]}])
    assert _verified(ok, [2.3, 2.2]).status == "ok"
    off = EngineRun("ok", "", [{"rank": 1, "losses": [2.31, 2.2]}])
    assert "rank 1's first losses" in _verified(off, [2.3, 2.2]).detail


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"model": "transformer"}, "choose an image model"),
        ({"tensor": (1,)}, "--tensor must be at least 2"),
        ({"warmup": 1}, "--warmup must be at least 2"),
        ({"steps": 0}, "--steps"),
    ],
)
def test_bad_options_are_refused(given: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SoapBenchOptions(**given)  # type: ignore[arg-type]


def test_one_tiny_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "soap.json"
    done = subprocess.run(
        [*CLI, "--model", "mlp", "--tensor", "2", "--steps", "2", "--warmup", "2", "--repeat", "1", "--timeout",
         "120", "--json", str(out)],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {k: v["status"] for k, v in report["engines"].items()} == {
        "single-mlp": "ok", "paratrain-mlp-t2": "ok", "torch-mlp-t2": "ok",
    }  # fmt: skip
    assert report["splits"] == {"2": {"1": "column", "3": "row"}}
    whole = report["results"]["single-mlp"]["parameter_bytes"][0]
    for engine in ("paratrain-mlp-t2", "torch-mlp-t2"):
        held = report["results"][engine]["parameter_bytes"]
        assert len(held) == 2 and max(held) < whole  # each rank holds part of the split layers
    assert "| paratrain soap | 2 |" in done.stdout and "| torch parallelize_module | 2 |" in done.stdout
