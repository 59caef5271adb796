"""Parameter-server workers restarted with real processes: ``paratrain train --strategy bsp --servers 2
--max-restarts 1`` with a worker SIGKILLed at a chosen step (from a warm spare, or cold; three workers and every
point of a clock: tests/algorithms/test_ps_rejoin.py), against the same job without the kill. Under BSP the final
model (SHA-256 of every parameter's bytes) and every epoch's train loss and test accuracy are bitwise the fault-free
run's; under SSP and ASP the job finishes at the fault-free accuracy. Small buckets make the dead worker's pushes of
the interrupted clock reach the servers partly (what must count once).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.train.record import read_records

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "paratrain.cli.main", "train", "--epochs", "2", "--servers", "2", "--max-restarts", "1"]


def _train(run_dir: Path, *flags: str) -> tuple[list[dict[str, object]], str]:
    out = subprocess.run(
        [*CLI, "--run-dir", str(run_dir), "--bucket-bytes", "2048", *flags],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_records(run_dir), out.stderr


def _outcome(records: list[dict[str, object]]) -> tuple[set[object], list[tuple[object, ...]]]:
    digests = {r["parameters_sha256"] for r in records if r["kind"] == "final"}
    evals = sorted((r["rank"], r["epoch"], r["train_loss"], r["test_accuracy"]) for r in records if r["kind"] == "eval")
    return digests, evals


@pytest.mark.parametrize(
    ("workers", "kill", "spare"),
    [("2", "1@step=7", True), ("2", "0@step=9", False)],
    ids=["warm-spare", "cold-reporting-rank"],
)
def test_a_killed_bsp_worker_rejoins_and_the_job_ends_bitwise_as_the_fault_free_one(
    tmp_path: Path, workers: str, kill: str, spare: bool
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    flags = ["--strategy", "bsp", "--workers", workers, *([] if spare else ["--no-spare"])]
    expected, _ = _train(tmp_path / "fault-free", *flags)
    records, stderr = _train(tmp_path / "killed", *flags, "--kill", kill)
    assert "restarting it " + ("from the warm spare" if spare else "cold") in stderr
    victim, step = int(kill.split("@", maxsplit=1)[0]), int(kill.split("=")[1])
    assert [r["step"] for r in records if r["kind"] == "rejoined"] == [step - 1]  # the interrupted clock, again
    assert "lacks steps" not in stderr
    digests, evals = _outcome(records)
    assert len(digests) == 1 and digests == _outcome(expected)[0]
    assert evals == _outcome(expected)[1]
    assert {r["rank"] for r in records if r["kind"] == "eval"} == set(range(int(workers)))
    assert victim in {r["rank"] for r in records if r["kind"] == "rejoined"}


@pytest.mark.parametrize(
    ("strategy", "kill", "spare"),
    [("ssp:2", "1@step=9", True), ("asp", "1@step=4", False)],
    ids=["ssp-warm", "asp-cold-after-the-other-finished"],
)
def test_a_killed_asynchronous_worker_rejoins_and_the_job_ends_at_the_fault_free_accuracy(
    tmp_path: Path, strategy: str, kill: str, spare: bool
) -> None:
    """SSP and ASP resume at the newest clock a server counted. Under ASP the other worker runs on (once the servers
    noticed the death a round of N pushes counts only the workers present) and finishes while the replacement starts
    cold: the server waits for it with every peer gone, and the job's model ends at the fault-free accuracy."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    flags = ["--strategy", strategy, "--workers", "2", *([] if spare else ["--no-spare"])]
    expected, _ = _train(tmp_path / "fault-free", *flags)
    records, _ = _train(tmp_path / "killed", *flags, "--kill", kill)
    assert [r["rank"] for r in records if r["kind"] == "rejoined"] == [1]
    assert _last_accuracy(records) >= _last_accuracy(expected) - 0.05


def _last_accuracy(records: list[dict[str, object]]) -> float:
    """The test accuracy of the worker that finished last: the servers' final parameters, which it pulled (under
    ASP a worker that finished early holds an older model)."""
    last = max((r for r in records if r["kind"] == "final"), key=lambda r: float(r["time"]))  # type: ignore[arg-type]
    evals = [r for r in records if r["kind"] == "eval" and r["rank"] == last["rank"]]
    return float(max(evals, key=lambda r: int(r["epoch"]))["test_accuracy"])  # type: ignore[call-overload, arg-type]


def test_the_readme_kvstore_example_survives_its_kill_with_the_same_parameters() -> None:
    """``paratrain/examples/ps_worker_restart.py`` under the launcher, with and without README's kill: every worker
    prints the same digest, the replacement from the interrupted clock."""
    command = [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--servers", "2", "--max-restarts", "1"]
    example = ["--", "python", "-m", "paratrain.examples.ps_worker_restart"]

    def digests(*kill: str) -> list[str]:
        out = subprocess.run([*command, *kill, *example], capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return sorted(line.split("]: ", 1)[1] for line in out.stdout.splitlines() if "parameters" in line)

    plain = digests()
    assert plain == [f"worker {r}: 30 clocks (from 0), parameters {plain[0].rsplit(' ', 1)[1]}" for r in (0, 1)]
    digest = plain[0].rsplit(" ", 1)[1]
    assert digests("--kill", "1@step=12") == [
        f"worker 0: 30 clocks (from 0), parameters {digest}",
        f"worker 1: 30 clocks (from 11), parameters {digest}",
    ]
