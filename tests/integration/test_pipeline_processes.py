"""Pipelines across real processes: each stage equals its slice of one-process training, and a killed stage
makes the other stages raise instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]

TRANSPARENT = """
import sys
import numpy as np, torch
from torch import nn
import paratrain as pt
from paratrain.torch.pipeline import Pipe

schedule, microbatches = sys.argv[1], int(sys.argv[2])
ctx = pt.init(timeout=60)

def layers():
    torch.manual_seed(3)
    return [nn.Linear(4, 7, dtype=torch.float64), nn.Tanh(), nn.Linear(7, 7, dtype=torch.float64), nn.Tanh(),
            nn.Linear(7, 2, dtype=torch.float64)]

def batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(6, 2, generator=gen, dtype=torch.float64)

balance = {2: [2, 3], 3: [2, 2, 1]}[ctx.world_size]
opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5)
pipe = Pipe(layers(), balance=balance, microbatches=microbatches, schedule=schedule, optimizer=opt,
            loss_fn=nn.MSELoss(reduction="sum"))
model = nn.Sequential(*layers())
ref_opt = opt(list(model.parameters()))
for step in range(3):
    x, y = batch(step)
    pipe.step(x, y)
    for xm, ym in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
        nn.MSELoss(reduction="sum")(model(xm), ym).backward()
    ref_opt.step(); ref_opt.zero_grad()
first = sum(balance[: ctx.rank])
ref = nn.Sequential(*list(model)[first : first + balance[ctx.rank]])
worst = max(float((a - b).abs().max()) for a, b in zip(pipe.module.parameters(), ref.parameters()))
print(f"stage {ctx.rank}: max difference {worst:.3g}", flush=True)
sys.exit(0 if worst <= 1e-12 else 3)
"""

KILLED = """
import os, signal
import torch
from torch import nn
import paratrain as pt
from paratrain.errors import PeerLostError
from paratrain.torch.pipeline import Pipe

ctx = pt.init(timeout=30)
torch.manual_seed(0)
layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)]
pipe = Pipe(layers, balance=[1, 1, 1], microbatches=4, schedule="1f1b",
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss(reduction="sum"))
try:
    for step in range(50):
        if ctx.rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        pipe.step(torch.ones(8, 4), torch.zeros(8, 1))
    print(f"stage {ctx.rank}: finished", flush=True)
except PeerLostError as exc:
    print(f"stage {ctx.rank}: lost stage {exc.peer}", flush=True)
"""


@pytest.mark.parametrize(("stages", "schedule", "microbatches"), [(2, "gpipe", 3), (3, "1f1b", 2), (3, "1f1b", 5)])
def test_each_stage_equals_its_slice_of_one_process(
    tmp_path: Path, stages: int, schedule: str, microbatches: int
) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TRANSPARENT))
    out = subprocess.run(
        [*LAUNCH, "-n", str(stages), str(script), schedule, str(microbatches)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("max difference") == stages


def test_a_killed_stage_makes_the_others_raise(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(KILLED))
    out = subprocess.run(
        [*LAUNCH, "-n", "3", "--keep-going", str(script)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "PARATRAIN_HEARTBEAT_TIMEOUT": "10"},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rank 1" in out.stderr and "SIGKILL" in out.stderr
    assert "stage 0: lost stage 1" in out.stdout and "stage 2: lost stage 1" in out.stdout, out.stdout + out.stderr
    assert "finished" not in out.stdout


def test_launch_stops_the_job_when_a_stage_dies(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(KILLED))
    out = subprocess.run([*LAUNCH, "-n", "3", str(script)], capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rank 1" in out.stderr and "finished" not in out.stdout
