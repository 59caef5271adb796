"""Recovery with real processes: `paratrain train --max-restarts 1` with a worker SIGKILLed at a chosen step.

The job completes, the survivor does not roll back (its steps run once, in order), the replacement catches up
from the survivor's memory, and the final model is bitwise equal (SHA-256 of every parameter's bytes) to the
fault-free run with the same seed. Kills before the first checkpoint, at a checkpoint's step and after one, on
the reporting rank and on the other; `paratrain bench recovery` runs the longer loop. Also: a resilient
transport tells every peer of a crash at once, so a rank waiting on a live peer learns of it too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.errors import PeerLostError
from paratrain.train.record import read_records
from paratrain.transport.zmq import ZmqTransport

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "paratrain.cli.main"]


def _train(run_dir: Path, *flags: str) -> list[dict[str, object]]:
    out = subprocess.run(
        [
            *CLI,
            "train",
            "--epochs",
            "2",
            "--max-restarts",
            "1",
            "--checkpoint-every",
            "5",
            "--run-dir",
            str(run_dir),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = read_records(run_dir)
    return records


def _digests(records: list[dict[str, object]]) -> set[object]:
    return {r["parameters_sha256"] for r in records if r["kind"] == "final"}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    digests = _digests(_train(tmp_path_factory.mktemp("ref")))
    assert len(digests) == 1  # both ranks hold the same model
    return str(next(iter(digests)))


# (kill, the operation everyone ran live next, results the replacement replayed): a broadcast is operation 0 and
# step k's allreduce operation k; checkpoints after steps 5, 10, ... are taken at operations 6, 11, ...
@pytest.mark.parametrize(
    ("kill", "frontier", "replayed"),
    [("1@step=3", 3, 3), ("0@step=5", 5, 5), ("1@step=6", 6, 0), ("0@step=14", 14, 3), ("1@checkpoint=2", 11, 0)],
)
def test_a_killed_worker_is_restarted_and_the_final_model_is_bitwise_the_fault_free_one(
    tmp_path: Path, fault_free: str, kill: str, frontier: int, replayed: int
) -> None:
    records = _train(tmp_path, "--kill", kill)
    assert _digests(records) == {fault_free}
    killed = int(kill[0])
    recoveries = [r for r in records if r["kind"] == "recovery"]
    assert {(r["rank"], r["restarted"]) for r in recoveries} == {(killed, True), (1 - killed, False)}
    # no rollback, nothing twice: every rank's steps are recorded once each, in order (the replacement does not
    # record the steps it replays)
    for rank in (0, 1):
        assert [r["step"] for r in records if r["kind"] == "step" and r["rank"] == rank] == list(range(1, 23))
    replacement = next(r for r in recoveries if r["restarted"])
    assert (replacement["frontier"], replacement["replayed"]) == (frontier, replayed)


def test_a_job_that_died_whole_resumes_from_its_disk_checkpoint_to_the_fault_free_model(
    tmp_path: Path, fault_free: str
) -> None:
    common = ["train", "--epochs", "2", "--checkpoint-every", "5", "--checkpoint-dir", str(tmp_path / "ckpt")]
    died = subprocess.run(
        [*CLI, *common, "--run-dir", str(tmp_path / "first"), "--kill", "1@step=12"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert died.returncode != 0 and (tmp_path / "ckpt" / "checkpoint.npz").exists(), died.stderr[-2000:]
    again = subprocess.run(
        [*CLI, *common, "--run-dir", str(tmp_path / "again")], capture_output=True, text=True, timeout=240, check=False
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "again" / "rank0.metrics.jsonl").read_text().splitlines()]
    assert min(r["step"] for r in records if r["kind"] == "step") == 11  # from the checkpoint after step 10
    assert {r["parameters_sha256"] for r in records if r["kind"] == "final"} == {fault_free}


def test_a_resilient_transport_breaks_every_receive_when_any_peer_crashes() -> None:
    transports = [
        ZmqTransport(rank=r, world_size=3, host_id="h", timeout=20, run_id="t", resilient=True) for r in range(3)
    ]
    table = [t.endpoints() for t in transports]
    for t in transports:
        t.connect(table)
    try:
        waiting = [transports[1].irecv(0, tag=5), transports[0].irecv(1, tag=5)]  # on live peers
        transports[2].abort()  # rank 2 crashes
        for handle in waiting:
            with pytest.raises(PeerLostError, match="peer rank 2"):
                handle.wait(10)
        assert 2 in transports[1].lost_peers() and 2 in transports[0].lost_peers()
        with pytest.raises(PeerLostError):  # and later receives fail too, until the job re-forms
            transports[1].recv(0, tag=6, timeout=10)
    finally:
        for t in transports:
            t.abort()


def test_the_readme_example_survives_its_kill_with_the_same_parameters() -> None:
    pytest.importorskip("torch")

    def run(*flags: str) -> set[str]:
        out = subprocess.run(
            [
                *CLI,
                "launch",
                "-n",
                "2",
                "--max-restarts",
                "1",
                *flags,
                "--",
                "python",
                "-m",
                "paratrain.examples.resilient",
            ],
            capture_output=True,
            text=True,
            timeout=200,
            check=False,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return {line.rsplit(" ", 1)[1] for line in out.stdout.splitlines() if "parameters" in line}

    killed = run("--kill", "1@step=7")
    assert len(killed) == 1 and killed == run()


@pytest.mark.parametrize("strategy", ["sfb", "poseidon:allreduce"])
def test_sfb_and_poseidon_over_allreduce_restart_a_killed_worker_to_the_fault_free_model(
    tmp_path: Path, strategy: str
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    # every SFB layer's factors are one reliable allgather and every dense bucket one reliable allreduce per step
    fault_free = _digests(_train(tmp_path / "ref", "--strategy", strategy))
    killed = _train(tmp_path / "killed", "--strategy", strategy, "--kill", "1@step=8")
    assert len(fault_free) == 1 and _digests(killed) == fault_free
    recoveries = [r for r in killed if r["kind"] == "recovery"]
    assert {(r["rank"], r["restarted"]) for r in recoveries} == {(1, True), (0, False)}
    assert next(r["replayed"] for r in recoveries if r["restarted"]) > 0  # steps 6-7's operations, from memory
    for rank in (0, 1):
        assert [r["step"] for r in killed if r["kind"] == "step" and r["rank"] == rank] == list(range(1, 23))
    # the reliable path computes what the strategy computes without it, to the bit
    plain = subprocess.run(
        [*CLI, "train", "--epochs", "2", "--strategy", strategy, "--run-dir", str(tmp_path / "plain")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert _digests(read_records(tmp_path / "plain")) == fault_free
