"""The STRADS engine with real processes: a worker SIGKILLed mid-round (Lasso) or mid-pick (matrix factorisation)
makes the scheduler and the other worker raise PeerLostError (no hang), under paratrain launch; the sched commands
end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.train.data import FASHION_MNIST_DIR

pytestmark = pytest.mark.timeout(90)

JOB = """
import os, signal
import numpy as np
import paratrain as pt
from paratrain.errors import PeerLostError, CommTimeoutError
import scipy.sparse as sp
from paratrain.sched.lasso_engine import lasso, strads, worker_rows
from paratrain.sched.mf_engine import factorize, worker_block

ctx = pt.init(timeout=30)
rng = np.random.default_rng(0)
x = rng.normal(size=(120, 20))
y = x @ rng.normal(size=20)
group = ctx.world
if ctx.rank == 2:  # dies at its 5th collective call: mid-round, deterministically
    original, calls = group.allreduce, [0]

    def allreduce(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    group.allreduce = allreduce
try:
    if os.environ["APP"] == "lasso":
        rows = (None, None) if ctx.rank == 0 else worker_rows(x, y, ctx.rank, ctx.world_size)
        lasso(ctx, *rows, alpha=0.01, make_scheduler=strads(4), max_updates=10_000)
    else:
        r = sp.csr_matrix(np.abs(x))
        block = None if ctx.rank == 0 else worker_block(r, ctx.rank, ctx.world_size)
        factorize(ctx, block, cols=20, rank=3, lam=0.1, picks=1000)
    print(f"rank {ctx.rank}: finished", flush=True)
except (PeerLostError, CommTimeoutError) as exc:
    print(f"rank {ctx.rank}: {type(exc).__name__} {getattr(exc, 'peer', '')}", flush=True)
"""


@pytest.mark.parametrize("app", ["lasso", "mf"])
def test_a_killed_worker_is_an_error_on_the_scheduler_and_the_other_worker(tmp_path: Path, app: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "3", "--keep-going", str(script)],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
        env={**os.environ, "PARATRAIN_HEARTBEAT_TIMEOUT": "10", "APP": app},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rank 2" in out.stderr and "SIGKILL" in out.stderr
    # the round's collective names the dead worker on the scheduler and on the other worker alike
    assert "rank 0: PeerLostError 2" in out.stdout and "rank 1: PeerLostError 2" in out.stdout, out.stdout
    assert "finished" not in out.stdout


def test_sched_commands_run_real_jobs_and_report_against_their_anchors(tmp_path: Path) -> None:
    """``paratrain sched pagerank`` and ``lasso`` end to end on small problems: the tables, the plot, no overlap."""
    run = [sys.executable, "-m", "paratrain.cli.main", "sched"]
    pr = subprocess.run(
        [
            *run,
            "pagerank",
            "--graph",
            "power-law:300",
            "--workers",
            "2",
            "--sweeps",
            "60",
            "--out",
            str(tmp_path / "p"),
        ],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert pr.returncode == 0, pr.stdout + pr.stderr
    assert "overlapping times (the engine's log): 0" in pr.stdout and "networkx pagerank" in pr.stdout
    assert (tmp_path / "p" / "pagerank.png").stat().st_size > 0
    small = ["--data", "synthetic", "--rows", "300", "--alpha", "0.05", "--workers", "2", "--max-updates", "3000"]
    lasso = subprocess.run(
        [*run, "lasso", *small, "--gap", "1e-2", "--out", str(tmp_path / "l")],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert lasso.returncode == 0, lasso.stdout + lasso.stderr
    assert "| strads |" in lasso.stdout and "| shotgun |" in lasso.stdout
    assert (tmp_path / "l" / "lasso.png").stat().st_size > 0 and (tmp_path / "l" / "lasso.json").is_file()


@pytest.mark.skipif(
    not any(Path(FASHION_MNIST_DIR).glob("train-images-idx3-ubyte*")), reason="Debian's Fashion-MNIST is not installed"
)
def test_sched_mf_runs_the_engine_against_the_dense_optimum(tmp_path: Path) -> None:
    """``paratrain sched mf`` on 300 Fashion-MNIST images (dense): both orders reach the shrunk SVD's optimum
    within the gap; on a sparse power-law matrix the held-out RMSE is reported."""
    run = [sys.executable, "-m", "paratrain.cli.main", "sched", "mf", "--workers", "2", "--rank", "4"]
    dense = subprocess.run(
        [*run, "--rows", "300", "--picks", "400", "--inner", "5", "--gap", "1e-2", "--out", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert dense.returncode == 0, dense.stdout + dense.stderr
    rows = [line.split("|") for line in dense.stdout.splitlines() if line.startswith(("| cyclic", "| priority"))]
    assert len(rows) == 2 and all(0 <= float(r[6]) <= 1e-2 for r in rows), dense.stdout  # never below it
    assert "300 x 784, 235200 entries" in dense.stdout  # the zero pixels are entries too
    sparse = subprocess.run(
        [*run, "--data", "power-law:600x150", "--picks", "20", "--orders", "cyclic", "--out", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert sparse.returncode == 0, sparse.stdout + sparse.stderr
    assert "| cyclic | 20 | 80 |" in sparse.stdout and (tmp_path / "s" / "mf.png").stat().st_size > 0


def test_bench_sched_lists_commands_the_parser_takes() -> None:
    """Every command of ``paratrain bench sched`` (full and quick) parses with the real ``paratrain`` parser, so the
    benchmark's settings cannot go stale against the flags; each writes into its own folder."""
    from paratrain.cli.bench_sched import suite
    from paratrain.cli.main import build_parser

    for quick in (False, True):
        runs = suite("out", quick=quick)
        assert len({name for name, _ in runs}) == len(runs)
        for name, argv in runs:
            args = build_parser().parse_args(argv)
            assert args.out == f"out/{name}" and args.command == "sched"
