"""`paratrain launch` and the runtime with real processes on loopback: the foundation's acceptance tests."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

LAUNCH = [sys.executable, "-m", "paratrain.cli.main", "launch"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_launch_four_ranks_ten_barriers() -> None:
    out = subprocess.run(
        [*LAUNCH, "-n", "4", "--", "python", "-m", "paratrain.examples.barriers"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if "barriers in" in ln]
    assert len(lines) == 4
    for r in range(4):
        assert any(ln.startswith(f"[rank{r}]: rank {r} of 4") for ln in lines), lines


def test_sigkilled_rank_stops_the_job_and_leaves_nothing(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        f"""
        import os, signal
        import paratrain as pt
        pt.init()
        with open(os.path.join({str(tmp_path)!r}, f"pid{{pt.rank()}}"), "w") as fh:
            fh.write(str(os.getpid()))
        pt.barrier()
        if pt.rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        pt.barrier(timeout=600)   # the others would wait here for ten minutes
    """,
    )
    start = time.monotonic()
    out = subprocess.run([*LAUNCH, "-n", "4", str(script)], capture_output=True, text=True, timeout=10, check=False)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert "rank 2" in out.stderr and "SIGKILL" in out.stderr, out.stderr
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
    assert not [p for p in pids if _alive(p)]
    print(f"launch exited {out.returncode} {elapsed:.2f}s after start")


def test_failing_rank_is_named_with_its_exit_code(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        import paratrain as pt
        pt.init()
        if pt.rank() == 1:
            sys.exit(3)
        pt.barrier(timeout=600)
    """,
    )
    out = subprocess.run([*LAUNCH, "-n", "3", str(script)], capture_output=True, text=True, timeout=20, check=False)
    assert out.returncode == 1
    # Rank 1's goodbye (sent at exit) can make ranks 0 and 2 fail before rank 1's process has ended; then the
    # launcher follows their lost-peer records back to rank 1. Either way the launcher's report names rank 1.
    report = [line for line in out.stderr.splitlines() if line.startswith("paratrain launch:")]
    assert any("rank 1 (pid" in line and "exited with code 3" in line for line in report) or any(
        "look first at rank 1's output" in line for line in report
    ), out.stderr


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, time
        import paratrain as pt
        pt.init()
        pt.barrier()
        print("ready", os.getpid(), flush=True)
        pt.barrier(timeout=600)
    """,
    )
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pids = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, "launch ended before the ranks were ready"
        if "ready" in line:
            pids.append(int(line.split()[-1]))
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=15) == 130
    assert not [p for p in pids if _alive(p)]


def test_bad_usage_gives_clear_errors() -> None:
    out = subprocess.run(
        [*LAUNCH, "-n", "0", "--", "python", "-c", "pass"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 2 and "-n must be at least 1" in out.stderr
    out = subprocess.run([*LAUNCH, "-n", "2"], capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "no command given" in out.stderr
    out = subprocess.run(
        [*LAUNCH, "--faults", "colour=red", "--", "python", "-c", "pass"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 2 and "unknown fault" in out.stderr
    for cmd in (["--help"], ["launch", "--help"], ["demo", "--help"]):
        help_out = subprocess.run(
            [sys.executable, "-m", "paratrain.cli.main", *cmd], capture_output=True, text=True, check=False
        )
        assert help_out.returncode == 0 and "usage:" in help_out.stdout


def _env_job(tmp_path: Path, extra: dict[str, str], world: int, rank_var: str) -> list[subprocess.Popen[str]]:
    """Starts ``world`` processes by hand with launcher-style variables (no paratrain launch)."""
    script = _script(
        tmp_path,
        """
        import os, signal
        import paratrain as pt
        from paratrain.errors import PeerLostError
        ctx = pt.init(timeout=30)
        print("joined", ctx.rank, ctx.world_size, ctx.settings.launched_by, flush=True)
        pt.barrier()
        # A killed process loses what it queued but had not yet sent, so rank 1 dies only once the others
        # confirmed they are past the barrier (else they could lose its last barrier token and fail there).
        if ctx.rank == 1:
            ctx.transport.recv(0, 5)
            ctx.transport.recv(2, 5)
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.transport.send(1, 5)
        if ctx.rank == 0:
            try:
                ctx.transport.recv(1, 77)
            except PeerLostError as exc:
                print("caught PeerLostError from rank", exc.peer, flush=True)
    """,
    )
    procs = []
    secret = secrets.token_hex(32)  # what the user exports on every rank when paratrain launch does not
    for r in range(world):
        env = dict(os.environ, **extra)
        env[rank_var] = str(r)
        env["PARATRAIN_SECRET"] = secret
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


@pytest.mark.parametrize("style", ["torchrun-env", "slurm"])
def test_without_paratrain_launch_and_peer_loss_surfaces(tmp_path: Path, style: str) -> None:
    port = _free_port()
    if style == "slurm":
        extra = {
            "SLURM_NTASKS": "3",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_LOCALID": "0",
            "SLURM_TASKS_PER_NODE": "3",
            "MASTER_PORT": str(port - 1),
        }
        rank_var = "SLURM_PROCID"
    else:
        extra = {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1)}
        rank_var = "RANK"
    procs = _env_job(tmp_path, extra, 3, rank_var)
    try:
        outs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert f"joined 0 3 {'slurm' if style == 'slurm' else 'env'}" in outs[0][0], outs[0]
    assert "caught PeerLostError from rank 1" in outs[0][0], outs[0]
    assert procs[0].returncode == 0 and procs[2].returncode == 0


def test_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = _script(
        tmp_path,
        """
        import paratrain as pt
        pt.init()
        for _ in range(10):
            pt.barrier()
        line = f"torchrun rank {pt.rank()} of {pt.world_size()} {pt.current().settings.launched_by}"
        with open(f"{__file__}.{pt.rank()}.out", "w") as fh:  # torchrun interleaves the ranks' stdout
            fh.write(line)
        pt.shutdown()
    """,
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        # MASTER_PORT + 1 may be taken; torchrun hands its environment, the job's secret too, to every rank
        env={**os.environ, "PARATRAIN_RDZV_PORT": str(_free_port()), "PARATRAIN_SECRET": secrets.token_hex(32)},
    )
    assert out.returncode == 0, out.stderr
    for r in range(2):
        assert Path(f"{script}.{r}.out").read_text() == f"torchrun rank {r} of 2 torchrun"
