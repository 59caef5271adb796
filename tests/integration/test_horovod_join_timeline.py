"""``hvd.join`` with uneven data and ``PARATRAIN_TIMELINE`` for a script on real processes: rank r trains 3 + r
steps with Horovod's DistributedOptimizer and joins; each step equals the one-process update with the joined
ranks' gradients as zeros, ``join`` returns the last rank everywhere, and every rank leaves a Chrome trace with
the Horovod tensors' phases and the DDP wrapper's collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

JOB = r"""
import torch
import paratrain.horovod as hvd
from paratrain.torch import DistributedDataParallel

hvd.init()
r, n = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for step in range(3 + r):  # uneven data: rank r has 3 + r batches
    opt.zero_grad()
    x = torch.arange(8, dtype=torch.float64).reshape(2, 4) * (step + 1) + r
    model(x).pow(2).sum().backward()
    opt.step()
last = hvd.join()
if r == n - 1:
    print("weights", " ".join(repr(v) for v in torch.cat([model.weight.flatten(), model.bias]).tolist()), flush=True)
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
rows = hvd.allgather(torch.cat([model.weight.flatten(), model.bias]).reshape(1, -1))
assert all(torch.equal(row, rows[0]) for row in rows)
ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
ddp(torch.ones(3, 2)).sum().backward()
print(f"rank {r}: joined, last {last}", flush=True)
hvd.shutdown()
"""


def reference(n: int) -> list[float]:
    """One process: step s averages the gradients of the ranks that still have data, zeros for the others."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3 + n - 1):
        opt.zero_grad()
        grads = []
        for r in range(n):
            if step >= 3 + r:
                continue
            model.zero_grad()
            x = torch.arange(8, dtype=torch.float64).reshape(2, 4) * (step + 1) + r
            model(x).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = sum(gs) / n
        opt.step()
    return torch.cat([model.weight.detach().flatten(), model.bias.detach()]).tolist()


@pytest.mark.parametrize("ranks", [2, 3])
def test_join_with_uneven_data_and_the_timeline_of_a_script(tmp_path: Path, ranks: int) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    timeline = tmp_path / "trace" / "timeline.json"
    out = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", str(ranks), str(script)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "PARATRAIN_TIMELINE": str(timeline)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(f"joined, last {ranks - 1}") == ranks, out.stdout
    line = next(x for x in out.stdout.splitlines() if "weights" in x)
    got = [float(v) for v in line.split("weights")[1].split()]
    assert got == pytest.approx(reference(ranks), rel=1e-12, abs=1e-12)

    for rank in range(ranks):
        path = timeline if rank == 0 else timeline.with_name(f"timeline.rank{rank}.json")
        events = json.loads(path.read_text())
        rows = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        names: dict[str, set[str]] = {}
        for e in events:
            if e.get("ph") == "X":
                names.setdefault(rows[e["pid"]], set()).add(e["name"])
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "COMMUNICATE"} <= names["allreduce.weight"], names
        assert "NEGOTIATE_JOIN" in names["join.noname.0"]
        assert {"QUEUE", "ALLREDUCE"} <= names["allreduce"]  # the DDP wrapper's gradients, through the context
        assert "BROADCAST" in names["broadcast"]  # its start from rank 0's parameters
