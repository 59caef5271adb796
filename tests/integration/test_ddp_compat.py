"""A DDP training script (torch's ``DistributedDataParallel`` and ``DistributedSampler`` over Gloo, under
torchrun) and the same script with paratrain's wrapper and sampler (its imports and init line changed, under
``paratrain launch``) end with bitwise the same parameters: 2 processes, digits, a model with BatchNorm buffers,
SGD with momentum, shuffled epochs, and gradient accumulation under ``no_sync()``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(150)

SCRIPT = r"""
import sys
import numpy as np
import torch
from sklearn.datasets import load_digits

if sys.argv[1] == "torch":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    import paratrain as pt
    from paratrain.torch import DistributedDataParallel as DDP
    from paratrain.torch import DistributedSampler

    pt.init()
    rank = pt.rank()

torch.manual_seed(rank)  # different initial weights: the wrapper must start every rank from rank 0's
digits = load_digits()
data = torch.utils.data.TensorDataset(torch.tensor(digits.data[:600] / 16.0, dtype=torch.float32),
                                      torch.tensor(digits.target[:600]))
sampler = DistributedSampler(data, shuffle=True, seed=7)
loader = torch.utils.data.DataLoader(data, batch_size=20, sampler=sampler)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for step, (x, y) in enumerate(loader):
        if step % 3 == 1:  # accumulate this batch locally, reduce with the next one
            with model.no_sync():
                torch.nn.functional.cross_entropy(model(x), y).backward()
            continue
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
if rank == 0:
    state = [t.detach().numpy().ravel() for t in model.module.state_dict().values() if t.dtype == torch.float32]
    np.save(sys.argv[2], np.concatenate(state))
"""


def test_a_ddp_script_reaches_ddps_parameters_exactly_with_paratrains_wrapper(tmp_path: Path) -> None:
    script = tmp_path / "ddp_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    anchor = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            "torch",
            str(tmp_path / "torch.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
        env=env,
    )
    assert anchor.returncode == 0, anchor.stdout + anchor.stderr
    ours = subprocess.run(
        [
            sys.executable,
            "-m",
            "paratrain.cli.main",
            "launch",
            "-n",
            "2",
            "--",
            "python",
            str(script),
            "paratrain",
            str(tmp_path / "paratrain.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
        env=env,
    )
    assert ours.returncode == 0, ours.stdout + ours.stderr
    want, got = np.load(tmp_path / "torch.npy"), np.load(tmp_path / "paratrain.npy")
    assert got.shape == want.shape and got.size > 2000
    assert np.array_equal(got, want), f"max difference {np.abs(got - want).max()}"
