"""The parameter server with real processes: `paratrain launch --servers`, and a worker killed mid-run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


JOB = """
import os, signal, sys
import numpy as np
import paratrain as pt
pt.init(timeout=60)
kv = pt.ps.KVStore(consistency="bsp")
kv.init("w", np.zeros(1 << 18, dtype=np.int64))
clocks = 6
for c in range(clocks):
    if pt.rank() == 1 and c == 3 and os.environ.get("KILL_ONE"):
        os.kill(os.getpid(), signal.SIGKILL)
    kv.push("w", np.ones(1 << 18, dtype=np.int64))
    kv.clock()
    value = kv.pull("w")
    lo = (pt.world_size() - (1 if os.environ.get("KILL_ONE") and c >= 3 else 0)) * (c + 1)
    assert value[0] >= lo, (c, value[0], lo)
print(f"worker {pt.rank()} finished {clocks} clocks, w[0] = {value[0]}", flush=True)
kv.close()
"""


def test_workers_and_servers_as_processes(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    out = subprocess.run(
        [*LAUNCH, "-n", "3", "--servers", "2", str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("finished 6 clocks, w[0] = 18") == 3, out.stdout


def test_killed_worker_does_not_hang_the_others(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    out = subprocess.run(
        [*LAUNCH, "-n", "3", "--servers", "2", "--keep-going", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**__import__("os").environ, "KILL_ONE": "1"},
    )
    assert out.returncode == 1  # a worker did fail, and launch says so ...
    assert "rank 1" in out.stderr and "SIGKILL" in out.stderr and "not essential" in out.stderr
    # ... but the two survivors finished every clock instead of waiting forever for the dead one
    assert out.stdout.count("finished 6 clocks") == 2, out.stdout + out.stderr


def test_same_script_serves_every_role_under_torchrun(tmp_path: Path) -> None:
    # Under torchrun, PARATRAIN_SERVERS=1 makes the last rank a server: its pt.init() serves, then exits.
    pytest.importorskip("torch")
    import os
    import secrets
    import socket

    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import numpy as np
        import paratrain as pt
        pt.init(timeout=60)
        kv = pt.ps.KVStore()
        kv.init("w", np.zeros(4))
        kv.push("w", np.ones(4))
        kv.clock()
        value = kv.pull("w")
        with open(f"{__file__}.{pt.rank()}.out", "w") as fh:
            fh.write(f"{pt.rank()} {pt.world_size()} {value[0]}")
        kv.close()
    """)
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--master-port",
            str(port),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        # the rendezvous port is reserved too: MASTER_PORT + 1 (the default) may be taken by another program
        env={
            **os.environ,
            "PARATRAIN_SERVERS": "1",
            "PARATRAIN_RDZV_PORT": str(_free_port()),
            "PARATRAIN_SECRET": secrets.token_hex(32),
        },
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.read_text() for p in tmp_path.glob("job.py.*.out")) == ["0 2 2.0", "1 2 2.0"]
