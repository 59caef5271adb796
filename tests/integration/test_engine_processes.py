"""Collectives through a torch.distributed engine (Gloo here) in real processes under ``paratrain launch``: the
process group is opened over the ranks' advertised addresses, results equal paratrain's own, and a rank that dies
is an error on the survivor (paratrain's agreement finds it before the engine would wait), not a hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(90)

SCRIPT = """
import os, sys, time
import torch
import paratrain as pt
from paratrain.errors import PeerLostError

ctx = pt.init()
engine = ctx.collectives.use_torch_distributed("gloo")
x = torch.arange(1 << 16, dtype=torch.float32) * (ctx.rank + 1)
same = torch.equal(ctx.allreduce(x), ctx.allreduce(x, algorithm="ring"))
out = open(sys.argv[1] + f".{ctx.rank}", "w")
out.write(f"rank {ctx.rank} engine calls {engine.calls} equal {same}\\n")
out.flush()
ctx.barrier()
# rank 1 leaves only once rank 0 says it is past the barrier: a send returns when the message is queued, so an
# os._exit straight after the barrier could drop rank 1's own barrier message and fail rank 0 inside the barrier
if ctx.rank == 0:
    ctx.transport.send(1, 7, meta={"past": "barrier"})
else:
    ctx.transport.recv(0, 7, timeout=30)
    os._exit(0)  # gone without a word: no shutdown
start = time.time()
try:
    ctx.allreduce(x, timeout=30)
    out.write("no error\\n")
except PeerLostError as exc:
    out.write(f"caught PeerLostError from rank {exc.peer} after {time.time() - start:.1f} s\\n")
out.close()
os._exit(0)
"""


def test_the_gloo_engine_across_processes_and_a_dead_peer(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    stem = str(tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--", sys.executable, str(script), stem],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    outs = [Path(f"{stem}.{r}").read_text() if Path(f"{stem}.{r}").exists() else "" for r in range(2)]
    assert "rank 0 engine calls 1 equal True" in outs[0], (outs, done.stderr[-2000:])
    assert "rank 1 engine calls 1 equal True" in outs[1], (outs, done.stderr[-2000:])
    assert "caught PeerLostError from rank 1" in outs[0], (outs, done.stderr[-2000:])
