"""Replicated parameter servers as real processes: ``paratrain launch --servers 2 --replicas 2``, with a server
SIGKILLed mid-run by a worker (at an exact clock, so the test orders nothing by time): the job completes, no
update is lost or applied twice, and the failover (death -> first push served by a backup) is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]

JOB = """
import json, os, signal, sys, time
import numpy as np
import paratrain as pt

def server_pid(index):
    # the launcher's server process `index` of this job (a test-only way to kill it at an exact clock)
    run_id = os.environ["PARATRAIN_RUN_ID"]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\\0") if b"=" in kv)
        except OSError:
            continue
        if (env.get(b"PARATRAIN_RUN_ID") == run_id.encode() and env.get(b"PARATRAIN_ROLE") == b"server"
                and env.get(b"RANK") == str(index).encode()):
            return int(entry)
    raise SystemExit(f"server {index} not found")

pt.init(timeout=60)
kill_at = int(os.environ.get("KILL_AT", "-1"))
victim = server_pid(0) if pt.rank() == 0 and kill_at >= 0 else None
kv = pt.ps.KVStore(consistency="bsp", chunk_bytes=4096)
size, clocks = 4096, 30
kv.init("n", np.zeros(size, dtype=np.int64))
killed = None
failover = None
for c in range(clocks):
    handle = kv.push("n", np.ones(size, dtype=np.int64))
    if victim is not None and c == kill_at:
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
    before = kv.failovers
    handle.wait(30)
    if kv.failovers and failover is None:
        failover = time.time()
    kv.clock()
kv.clock()
total = kv.pull("n")
copies = kv.pull_replicas("n")
out = {"rank": pt.rank(), "total": total.tolist(), "copies": [c.tolist() for c in copies],
       "killed": killed, "failover": failover, "failovers": kv.failovers, "replicas": kv.replicas}
with open(os.path.join(os.environ["OUT_DIR"], f"rank{pt.rank()}.json"), "w") as f:
    json.dump(out, f)
kv.close()
"""


def _run(tmp_path: Path, *args: str, kill_at: int = -1) -> list[dict[str, object]]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {**os.environ, "OUT_DIR": str(tmp_path), "KILL_AT": str(kill_at)}
    out = subprocess.run(
        [*LAUNCH, "-n", "3", "--servers", "2", *args, str(script)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    if kill_at >= 0:  # the launcher reports the dead server, and that the job completed without it
        assert "server 0 died; its chunks failed over to their backups" in out.stderr, out.stderr
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]


def test_replicated_job_as_processes(tmp_path: Path) -> None:
    for result in _run(tmp_path, "--replicas", "2"):
        assert result["replicas"] == 2
        assert result["total"] == [3 * 30] * 4096
        assert result["copies"] == [result["total"]] * 2


def test_killed_server_fails_over_without_losing_or_doubling_an_update(tmp_path: Path) -> None:
    results = _run(tmp_path, "--replicas", "2", kill_at=10)
    for result in results:
        assert result["total"] == [3 * 30] * 4096  # 90 pushes of 1 per element: none lost, none applied twice
    killed = results[0]["killed"]
    assert isinstance(killed, float)
    delays = [r["failover"] - killed for r in results if isinstance(r["failover"], float)]
    assert delays, "no worker failed over"
    print(f"failover (SIGKILL -> first push acknowledged by a backup), per worker: {[round(d, 4) for d in delays]} s")


def test_replicas_above_servers_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('never runs')\n")
    out = subprocess.run(
        [*LAUNCH, "-n", "1", "--servers", "1", "--replicas", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "--replicas 2" in out.stderr
