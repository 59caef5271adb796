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
from paratrain.pipeline.schedules import pipedream
from paratrain.torch.pipeline import Pipe

ctx = pt.init(timeout=60)
K, STEPS = ctx.world_size, 3

def layers():
    torch.manual_seed(3)
    return [nn.Linear(4, 7, dtype=torch.float64), nn.Tanh(), nn.Linear(7, 7, dtype=torch.float64), nn.Tanh(),
            nn.Linear(7, 7, dtype=torch.float64), nn.Tanh(), nn.Linear(7, 2, dtype=torch.float64)]

def batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64)

balance = {2: [4, 3], 3: [2, 2, 3], 4: [2, 2, 2, 1]}[K]
first = sum(balance[: ctx.rank])
opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5)
loss_fn = nn.MSELoss(reduction="sum")
failed = 0
for schedule in ("gpipe", "1f1b", "pipedream", "pipedream-vsync"):
    for microbatches in (1, 2, 3, 5, 8):
        pipe = Pipe(layers(), balance=balance, microbatches=microbatches, schedule=schedule, optimizer=opt,
                    loss_fn=loss_fn)
        for step in range(STEPS):
            x, y = batch(step)
            pipe.step(x, y)
        if schedule.startswith("pipedream"):  # white-box: every forward and backward used the planned version
            plan = pipedream(K, microbatches, vertical_sync=schedule.endswith("vsync")).stages[ctx.rank]
            taken = sum(1 for st in plan if st.kind == "S")
            want = [(st.kind, st.microbatch, st.version + s * taken)
                    for s in range(STEPS) for st in plan if st.kind != "S"]
            ok = pipe.versions == want
            print(f"stage {ctx.rank} {schedule} M={microbatches}: versions {'as planned' if ok else 'DIFFER'}")
            failed += not ok
            continue
        model = nn.Sequential(*layers())
        ref_opt = opt(list(model.parameters()))
        for step in range(STEPS):
            x, y = batch(step)
            for xm, ym in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
                loss_fn(model(xm), ym).backward()
            ref_opt.step(); ref_opt.zero_grad()
        ref = nn.Sequential(*list(model)[first : first + balance[ctx.rank]])
        worst = max(float((a - b).abs().max()) for a, b in zip(pipe.module.parameters(), ref.parameters()))
        tensors = len(list(ref.parameters()))
        print(f"stage {ctx.rank} {schedule} M={microbatches}: {tensors} tensors, max difference {worst:.3g}")
        failed += not worst <= 1e-12
sys.stdout.flush()
sys.exit(3 if failed else 0)
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


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_each_stage_equals_its_slice_of_one_process(tmp_path: Path, stages: int) -> None:
    """GPipe and 1F1B x 1, 2, 3, 5, 8 micro-batches: every parameter tensor of every stage equals one process's
    (float64, 1e-12) after 3 steps; PipeDream, with and without vertical sync: every forward and backward used its
    planned weight version."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TRANSPARENT))
    out = subprocess.run(
        [*LAUNCH, "-n", str(stages), str(script)], capture_output=True, text=True, timeout=110, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("max difference") == stages * 2 * 5, out.stdout
    assert out.stdout.count("versions as planned") == stages * 2 * 5, out.stdout


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
