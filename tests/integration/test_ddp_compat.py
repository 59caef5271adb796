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
else:  # "paratrain", or "paratrain:STRATEGY"
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
net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
if ":" in sys.argv[1]:  # a paratrain strategy on the wrapper
    model = DDP(net, strategy=sys.argv[1].split(":", 1)[1], optimizer=opt)
else:
    model = DDP(net)
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
if sys.argv[1] == "torch":  # as torch asks; without it Gloo's threads were seen to abort the interpreter's exit
    dist.destroy_process_group()
"""


# torch's own Gloo runs (the anchors) abort now and then as they exit: in about 1 of 20 runs on this VM a rank
# printed its results and then died of SIGABRT ("terminate called without an active exception", from a Gloo thread)
# and torchrun failed the job. That one signature is run again once; paratrain's runs never are.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def _run(args: list[str], *, anchor: bool = False) -> str:
    """Runs a launcher command; returns its stdout, failing with everything it printed."""
    for left in reversed(range(2 if anchor else 1)):
        out = subprocess.run(
            args, capture_output=True, text=True, timeout=140, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if out.returncode == 0 or not left or TORCH_EXIT_ABORT not in out.stderr:
            break
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def anchor(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The script under torchrun with torch's DDP over Gloo: its final parameters."""
    tmp = tmp_path_factory.mktemp("ddp")
    script = tmp / "ddp_script.py"
    script.write_text(SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run([*torchrun, str(script), "torch", str(tmp / "torch.npy")], anchor=True)
    return script, np.load(tmp / "torch.npy")


def test_a_ddp_script_reaches_ddps_parameters_exactly_with_paratrains_wrapper(
    anchor: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    script, want = anchor
    launch = [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--"]
    _run([*launch, "python", str(script), "paratrain", str(tmp_path / "paratrain.npy")])
    got = np.load(tmp_path / "paratrain.npy")
    assert got.shape == want.shape and got.size > 2000
    assert np.array_equal(got, want), f"max difference {np.abs(got - want).max()}"


@pytest.mark.parametrize(("strategy", "servers", "tol"), [("allreduce", 0, 0.0), ("bsp", 1, 1e-5)])
def test_paratrain_strategies_on_the_wrapper_reach_ddps_parameters(
    anchor: tuple[Path, np.ndarray], tmp_path: Path, strategy: str, servers: int, tol: float
) -> None:
    """The same script with ``DistributedDataParallel(net, strategy=..., optimizer=opt)``: allreduce in fused
    buckets equals DDP to the bit (2 ranks: halving is exact), BSP through a parameter server (which runs SGD
    with momentum itself) to float32 rounding."""
    script, want = anchor
    launch = [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--servers", str(servers), "--"]
    _run([*launch, "python", str(script), f"paratrain:{strategy}", str(tmp_path / "ours.npy")])
    got = np.load(tmp_path / "ours.npy")
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol, f"max difference {np.abs(got - want).max()}"


def test_the_readme_ddp_example_ends_with_torchs_parameters_on_both_backends() -> None:
    """``paratrain.examples.ddp_digits`` (README's side-by-side commands), one epoch: the checksum of the final
    parameters under torchrun with torch's DDP and under paratrain launch with paratrain's is the same."""
    runs = [
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--", "python"],
    ]
    sums = []
    for backend, prefix in zip(["torch", "paratrain"], runs, strict=True):
        args = [*prefix, "-m", "paratrain.examples.ddp_digits", "--epochs", "1", "--backend", backend]
        stdout = _run(args, anchor=backend == "torch")
        sums.append(next(line.split()[-1] for line in stdout.splitlines() if "sha256" in line))
    assert sums[0] == sums[1]
