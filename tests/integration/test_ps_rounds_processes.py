"""SSP(0) is BSP, parameter for parameter, with real worker and server processes (paratrain launch).

Three workers fit a linear regression on their own data through two servers (the key spans both), with a
server-side momentum SGD or Adam. BSP and SSP with s = 0 must give the same parameters as one process taking
one optimizer step per clock on the mean of the workers' gradients; only the order in which a server sums
three gradients may differ between runs, hence the 1e-12 tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from paratrain.ps.optim import make_optimizer

pytestmark = pytest.mark.timeout(120)

LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]
WORKERS, CLOCKS, DIM = 3, 8, 40
OPTIMIZERS = {
    "momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "adam": {"name": "adam", "lr": 0.05},
}

JOB = """
import json, os, sys
import numpy as np
import paratrain as pt

def data(rank):
    gen = np.random.default_rng(100 + rank)
    x = gen.standard_normal((32, {dim}))
    return x, x @ np.linspace(-1, 1, {dim}) + 0.1 * gen.standard_normal(32)

pt.init(timeout=60)
kind, staleness = sys.argv[1].partition(":")[::2]
kv = pt.ps.KVStore(kind, int(staleness) if staleness else None, json.loads(sys.argv[2]), chunk_bytes=128)
kv.init("w", np.zeros({dim}))
x, y = data(pt.rank())
for _ in range({clocks}):
    w = kv.pull("w")
    kv.push("w", x.T @ (x @ w - y) / len(y)).wait(30)
    kv.clock()
w = kv.pull("w")
if pt.rank() == 0:
    np.save(sys.argv[3], w)
kv.close()
"""


def _reference(spec: dict[str, object]) -> np.ndarray:
    opt = make_optimizer(spec)
    assert opt is not None
    w = np.zeros(DIM)
    state = opt.init_state(w)
    sets = []
    for rank in range(WORKERS):
        gen = np.random.default_rng(100 + rank)
        x = gen.standard_normal((32, DIM))
        sets.append((x, x @ np.linspace(-1, 1, DIM) + 0.1 * gen.standard_normal(32)))
    for _ in range(CLOCKS):
        grads = [x.T @ (x @ w - y) / len(y) for x, y in sets]
        opt.step(w, (grads[0] + grads[1] + grads[2]) / WORKERS, state)
    return w


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_ssp0_equals_bsp_and_synchronous_sgd_across_processes(tmp_path: Path, optimizer: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB.format(dim=DIM, clocks=CLOCKS)))
    spec = OPTIMIZERS[optimizer]
    results = {}
    for strategy in ("bsp", "ssp:0"):
        out_file = tmp_path / f"{strategy.replace(':', '')}.npy"
        run = subprocess.run(
            [*LAUNCH, "-n", str(WORKERS), "--servers", "2", str(script), strategy, json.dumps(spec), str(out_file)],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        results[strategy] = np.load(out_file)
    reference = _reference(spec)
    assert not np.allclose(reference, 0)  # it trained
    np.testing.assert_allclose(results["ssp:0"], results["bsp"], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(results["bsp"], reference, rtol=1e-12, atol=1e-15)
