"""Kill schedules end to end: `paratrain launch --kill` and `paratrain train --kill` kill exactly the process
they name, at its step or time, say so, and the launcher stops the job as for any failure (no restarts yet)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "paratrain.cli.main"]

STEPS = """
import torch
import paratrain as pt
import paratrain.torch as ptt

ctx = pt.init(timeout=30)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = ptt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
for step in range(1, 8):
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    print(f"rank {ctx.rank} finished step {step}", flush=True)
pt.shutdown()
"""

BARRIERS = """
import paratrain as pt
ctx = pt.init(timeout=30)
while True:
    ctx.barrier()
"""


def _launch(tmp: Path, script: str, *flags: str) -> subprocess.CompletedProcess[str]:
    path = tmp / "job.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run(
        [*CLI, "launch", "-n", "2", *flags, str(path)], capture_output=True, text=True, timeout=110, check=False
    )


def test_a_step_kill_fires_as_the_rank_s_step_begins(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = _launch(tmp_path, STEPS, "--kill", "1@step=3")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "injected fault: SIGKILL at step 3 (--kill 1@step=3)" in out.stderr
    assert "rank 1 (pid" in out.stderr and "was killed by signal SIGKILL" in out.stderr
    assert "rank 1 finished step 2" in out.stdout and "rank 1 finished step 3" not in out.stdout
    assert "rank 0 finished step 7" not in out.stdout


def test_a_time_kill_is_sent_by_the_launcher(tmp_path: Path) -> None:
    out = _launch(tmp_path, BARRIERS, "--kill", "1@1.5s:TERM")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "injected fault: SIGTERM to rank 1 1.5 s after the start (--kill 1@1.5s:TERM)" in out.stderr
    assert "rank 1 (pid" in out.stderr and "was killed by signal SIGTERM" in out.stderr


def test_a_bad_schedule_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = _launch(tmp_path, BARRIERS, "--kill", "4@step=2")
    assert out.returncode == 2
    assert "the job has 2 worker(s), ranks 0..1" in out.stderr


def test_train_takes_a_kill_schedule(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    base = [*CLI, "train", "--run-dir", str(tmp_path / "run"), "--epochs", "1"]
    out = subprocess.run([*base, "--kill", "1@step=4"], capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode != 0
    assert "injected fault: SIGKILL at step 4 (--kill 1@step=4)" in out.stdout + out.stderr
    bad = subprocess.run([*base, "--kill", "2@step=4"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "the job has 2 worker(s)" in bad.stderr
