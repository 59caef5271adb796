"""Pipeline stages restarted with real processes: ``paratrain train --strategy pipeline:... --max-restarts 1`` with
a stage SIGKILLed at a chosen step, against the same job without the kill. Every stage's final weights (SHA-256;
they differ by stage) and every epoch's train loss and test accuracy are bitwise the fault-free run's, every
rank's step records run 1..16 once, and the ranks rolled back to the newest checkpoint (step 3 here).

Two paths: a stage's copy kept by the next stage (1F1B, three stages, the replacement started cold), and a
replicated stage's state received from its twin in the other pipeline (PipeDream, two pipelines of two stages,
a warm spare).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.train.record import read_records, run_outcome

pytestmark = pytest.mark.timeout(300)

FLAGS = ["--epochs", "2", "--steps-per-epoch", "8", "--max-restarts", "1", "--checkpoint-every", "3"]
JOBS = {
    "buddy": ["--strategy", "pipeline:1f1b", "--workers", "3", "--balance", "3,1,2", "--no-spare"],
    "twin": ["--strategy", "pipeline:pipedream", "--workers", "4", "--replicas", "2", "--balance", "2,4"],
}


def _train(run_dir: Path, *flags: str) -> tuple[list[dict[str, object]], str]:
    cli = [sys.executable, "-m", "paratrain.cli.main", "train", *FLAGS, "--run-dir", str(run_dir), *flags]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_records(run_dir), out.stderr


@pytest.mark.parametrize(
    ("job", "kill", "rejoined"),
    [("buddy", "1@step=5", 1), ("twin", "3@step=5", 3)],
    ids=["copy-at-the-next-stage-cold", "copy-from-the-twin-stage-warm-spare"],
)
def test_a_killed_stage_is_replaced_and_every_stage_ends_bitwise(
    tmp_path: Path, job: str, kill: str, rejoined: int
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    fault_free, _ = _train(tmp_path / "fault-free", *JOBS[job])
    records, stderr = _train(tmp_path / "killed", *JOBS[job], "--kill", kill)
    assert "restarting it " + ("cold" if "--no-spare" in JOBS[job] else "from the warm spare") in stderr
    finals, evals = run_outcome(records)
    workers = int(JOBS[job][JOBS[job].index("--workers") + 1])
    assert len(finals) == workers
    assert finals == run_outcome(fault_free)[0]  # every stage's weights, to the bit
    assert evals == run_outcome(fault_free)[1] and len(evals) == 2
    rollbacks = {(r["rank"], r["step"]) for r in records if r["kind"] == "rollback"}
    assert rollbacks == {(rank, 3) for rank in range(workers) if rank != rejoined}
    assert [(r["rank"], r["step"]) for r in records if r["kind"] == "rejoined"] == [(rejoined, 3)]
    for rank in range(workers):
        assert [r["step"] for r in records if r["kind"] == "step" and r["rank"] == rank] == list(range(1, 17))
