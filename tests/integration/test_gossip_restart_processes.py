"""Gossip workers restarted with real processes: ``paratrain train --strategy gossip:ring --workers 3
--max-restarts 2`` with two workers SIGKILLed at chosen steps (restarted cold: before the first checkpoint's copy
arrived, and at the last step, met in the final evaluation's allreduce), against the
same job without the kill. Every worker's final model (SHA-256 of its parameters' bytes; they differ by worker)
and every epoch's train loss and test accuracy are bitwise the fault-free run's, and every rank's step records run
1..14 once (the steps run again after a rollback are not recorded twice).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.train.record import read_records, run_outcome

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "paratrain.cli.main", "train", "--strategy", "gossip:ring", "--workers", "3"]
FLAGS = ["--epochs", "2", "--max-restarts", "1", "--checkpoint-every", "3"]


def _train(run_dir: Path, *flags: str) -> tuple[list[dict[str, object]], str]:
    out = subprocess.run(
        [*CLI, *FLAGS, "--run-dir", str(run_dir), *flags], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_records(run_dir), out.stderr


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    records, _ = _train(tmp_path_factory.mktemp("gossip") / "fault-free")
    return records


@pytest.mark.parametrize(
    ("kill", "spare", "rollbacks"),
    [
        # before the first copy arrived (back to step 0, rebuilt), then at the last step: the others finished it
        # and met the death in the final evaluation's allreduce (back to 12, rank 2's state the copy its buddy,
        # the first replacement, holds); a warm spare's path is the launcher's, as for every strategy (bench chaos)
        ("0@step=2,2@step=14", False, {(1, 0), (2, 0), (0, 12), (1, 12)}),
    ],
    ids=["cold-before-the-first-copy-then-at-the-last-step"],
)
def test_a_killed_gossip_worker_is_replaced_and_every_model_ends_bitwise(
    tmp_path: Path, fault_free: list[dict[str, object]], kill: str, spare: bool, rollbacks: set[tuple[int, int]]
) -> None:
    deaths = str(kill.count("@"))
    flags = ["--kill", kill, "--max-restarts", deaths, *([] if spare else ["--no-spare"])]
    records, stderr = _train(tmp_path / "killed", *flags)
    assert "restarting it " + ("from the warm spare" if spare else "cold") in stderr
    finals, evals = run_outcome(records)
    assert len({digest for _, digest in finals}) == 3  # gossip's workers hold different models...
    assert finals == run_outcome(fault_free)[0]  # ... each the fault-free run's, to the bit
    assert evals == run_outcome(fault_free)[1]
    assert {(r["rank"], r["step"]) for r in records if r["kind"] == "rollback"} == rollbacks
    for rank in range(3):
        assert [r["step"] for r in records if r["kind"] == "step" and r["rank"] == rank] == list(range(1, 15))
