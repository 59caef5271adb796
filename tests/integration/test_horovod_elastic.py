"""Horovod's elastic API on real processes (``paratrain.examples.horovod_elastic`` under ``paratrain launch
--min-workers``): a killed worker's survivors restore their last commit and re-form as a smaller job; a cold
replacement is taken in at a commit and receives rank 0's state; every rank ends with the same parameters."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

CLI = [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "3", "--min-workers", "2"]
EXAMPLE = ["--", "python", "-m", "paratrain.examples.horovod_elastic", "--epochs", "2"]
LINE = re.compile(r"rank (\d+) of (\d+): (\d+) epochs, (\d+) resets, accuracy ([\d.]+), parameters ([0-9a-f]+)")


def _launch(*flags: str) -> tuple[int, list[tuple[int, int, int, int, float, str]], str]:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = subprocess.run([*CLI, *flags], capture_output=True, text=True, timeout=240, check=False)
    rows = [
        (int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5]), m[6])
        for m in (LINE.search(line) for line in out.stdout.splitlines())
        if m
    ]
    return out.returncode, sorted(rows), out.stdout[-3000:] + out.stderr[-3000:]


def test_a_killed_workers_survivors_go_on_as_two_from_their_last_commit() -> None:
    code, rows, log = _launch("--kill", "1@step=6", *EXAMPLE)
    assert code == 0, log
    assert [(r, size, epochs, resets) for r, size, epochs, resets, _, _ in rows] == [(0, 2, 2, 1), (1, 2, 2, 1)], log
    assert len({digest for *_, digest in rows}) == 1, log  # rank 0's state, then the same steps
    assert all(accuracy > 0.8 for *_, accuracy, _ in rows), log


def test_a_cold_replacement_joins_at_a_commit_and_receives_the_state() -> None:
    code, rows, log = _launch("--max-restarts", "1", "--no-spare", "--kill", "1@step=6", *EXAMPLE, "--until-joined")
    assert code == 0, log
    # one reset for the death, one for the join: the joiner was given the count with the state
    assert [(r, size, resets) for r, size, _, resets, _, _ in rows] == [(0, 3, 2), (1, 3, 2), (2, 3, 2)], log
    assert len({digest for *_, digest in rows}) == 1 and len({epochs for _, _, epochs, *_ in rows}) == 1, log


def test_without_min_workers_the_error_ends_the_job() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--kill", "1@step=3", *EXAMPLE],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "rank 1" in out.stderr and "SIGKILL" in out.stderr


def test_the_elastic_sampler_shares_the_rest_of_the_epoch_among_the_survivors() -> None:
    code, rows, log = _launch("--kill", "1@step=6", *EXAMPLE, "--sampler")
    assert code == 0, log
    assert [(r, size, epochs, resets) for r, size, epochs, resets, _, _ in rows] == [(0, 2, 2, 1), (1, 2, 2, 1)], log
    assert len({digest for *_, digest in rows}) == 1, log
    assert all(accuracy > 0.8 for *_, accuracy, _ in rows), log
