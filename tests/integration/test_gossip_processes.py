"""Gossip with real processes: a worker SIGKILLed mid-training makes its neighbours fail with PeerLostError."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(90)

LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]

JOB = """
import os, signal
import torch
import paratrain as pt
import paratrain.torch as ptt
from paratrain.errors import PeerLostError

ctx = pt.init(timeout=30)
torch.manual_seed(ctx.rank)
model = torch.nn.Linear(8, 2)
opt = ptt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, strategy="gossip:ring")
try:
    for step in range(20):
        if ctx.rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    print(f"rank {ctx.rank}: finished", flush=True)
except PeerLostError as exc:
    print(f"rank {ctx.rank}: lost peer {exc.peer}", flush=True)
"""


def test_neighbours_of_a_killed_worker_get_peer_lost(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    out = subprocess.run(
        [*LAUNCH, "-n", "3", "--keep-going", str(script)],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
        env={**os.environ, "PARATRAIN_HEARTBEAT_TIMEOUT": "10"},
    )
    assert out.returncode == 1, out.stdout + out.stderr  # rank 1 was killed, and launch says so
    assert "rank 1" in out.stderr and "SIGKILL" in out.stderr
    # on a ring of 3 both survivors are rank 1's neighbours: each learns which peer it lost, nobody hangs
    assert "rank 0: lost peer 1" in out.stdout and "rank 2: lost peer 1" in out.stdout, out.stdout + out.stderr
    assert "finished" not in out.stdout
