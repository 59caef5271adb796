"""SFB with real processes: the gradient every worker rebuilds from the gathered factors equals the mean of the
workers' dense gradients, which each process also computes on its own (it knows every worker's seeded batch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)

LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]

JOB = """
import sys
import torch
import paratrain as pt
import paratrain.torch as ptt

torch.set_num_threads(1)
ctx = pt.init(timeout=60)
P = ctx.world_size
ROWS = [3, 7, 1, 5][:P]  # unequal batches, one of a single row; 7 > min(M, N) of the 6x4 layer


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6, bias=False), torch.nn.Tanh(),
        torch.nn.Linear(6, 2),
    ).double()


def batch(rank):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(ROWS[rank], 4, generator=gen, dtype=torch.float64)
    return x, torch.randn(ROWS[rank], 2, generator=gen, dtype=torch.float64)


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


want = 0
for rank in range(P):  # the single-process reference: the mean of every worker's own gradient
    model = net()
    x, y = batch(rank)
    ((model(x) - y) ** 2).sum().backward()
    want = want + grads(model) / P

SETTINGS = {
    "sfb": {},
    "poseidon:allreduce": {"batch_size": 4},
    # the servers step layer 4 themselves (its grad stays local): compare the two SFB layers, 4x6+6 + 6x6 numbers
    "poseidon": {"batch_size": 4, "layer_schemes": {"0": "sfb", "2": "sfb"}},
}
for strategy in sys.argv[1:]:
    model = net()
    opt = ptt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, strategy=strategy, **SETTINGS[strategy]
    )
    x, y = batch(ctx.rank)
    ((model(x) - y) ** 2).sum().backward()
    opt.synchronize()
    got = grads(model)
    n = 66 if strategy == "poseidon" else got.numel()
    same = torch.allclose(got[:n], want[:n], rtol=1e-12, atol=1e-12)
    sfb = opt.hybrid_plan.sfb_layers
    opt.close()
    diff = (got - want)[:n].abs().max().item()
    print(f"rank {ctx.rank} {strategy}: equal={same} sfb={','.join(sfb)} diff={diff:.1e}", flush=True)
"""


@pytest.mark.parametrize(("workers", "servers"), [(2, 0), (4, 1)])
def test_sfb_gradients_equal_the_dense_mean_across_processes(tmp_path: Path, workers: int, servers: int) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    strategies = ["sfb", "poseidon:allreduce"] + (["poseidon"] if servers else [])
    out = subprocess.run(
        [*LAUNCH, "-n", str(workers), "--servers", str(servers), str(script), *strategies],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if "]: rank " in line]
    assert len(lines) == workers * len(strategies), out.stdout + out.stderr
    assert all("equal=True" in line for line in lines), out.stdout
    # sfb sends all three Linear layers by their factors
    assert all("sfb=0,2,4" in line for line in lines if " sfb: " in line), out.stdout
    assert all("sfb=0,2 " in line for line in lines if " poseidon: " in line), out.stdout
