"""Servers joining and leaving a running parameter-server job of real processes (``paratrain launch --servers 4``
and ``paratrain.examples.ps_resize``): worker 0 adds a server at clock 3, worker 1 removes another at clock 6,
and every element of every key ends at workers x clocks (an integer audit: no update lost or counted twice)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_server_joins_and_another_leaves_while_the_workers_train() -> None:
    args = [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--servers", "4", "--"]
    example = ["python", "-m", "paratrain.examples.ps_resize", "--mib", "1", "--clocks", "10", "--chunk-kib", "32"]
    out = subprocess.run(
        [*args, *example, "--add-at", "3", "--remove-at", "6"], check=False, capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("every update counted once (2 workers x 10 clocks)") == 2, out.stdout
    reports = {
        r["rank"]: r
        for r in (json.loads(line.split(": ", 1)[1]) for line in out.stdout.splitlines() if '{"rank"' in line)
    }
    assert sorted(reports) == [0, 1] and all(r["active_at_end"] == [1, 2] for r in reports.values())
    added, removed = reports[0]["resizes"][0], reports[1]["resizes"][0]
    assert added["what"] == "add" and added["active"] == [0, 1, 2] and added["chunks"] > 0
    assert removed["what"] == "remove" and removed["active"] == [1, 2] and removed["chunks"] > 0
    assert all(len(r["pauses_s"]) == 2 for r in reports.values())  # each worker fenced once per resize
