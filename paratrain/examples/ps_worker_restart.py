"""A parameter-server job whose killed worker is restarted and takes its place while the others go on.

Run it with a failure on purpose::

    paratrain launch -n 2 --servers 2 --max-restarts 1 --kill 1@step=12 \\
        -- python -m paratrain.examples.ps_worker_restart

Worker 1 dies (SIGKILL) as its 12th step begins. The servers hold its place; the launcher restarts it from a warm
spare, whose ``KVStore`` rejoins the servers (:mod:`paratrain.ps.rejoin`) at the clock they counted for it: it
computes the interrupted clock again and goes on from there (``kv.resumed_clock``), while worker 0 only waits for
it, as for a straggler. The parameters and the optimizer's state (SGD with momentum) live on the servers, so nothing
else needs saving. Every worker prints the SHA-256 of the final parameters: the same with and without the kill.

The data of a step depend on the step and the worker only, so the replacement sees what its predecessor saw. Only
numpy is needed.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np

import paratrain as pt
from paratrain.launch.kills import kill_point
from paratrain.ps import KVStore

_SIZE = 4096


def _gradient(w: np.ndarray, rank: int, step: int) -> np.ndarray:
    """A least-squares gradient on this worker's data of this step (fixed by the step and the worker)."""
    rng = np.random.default_rng([step, rank])
    x = rng.standard_normal((16, w.size)) / np.sqrt(w.size)
    target = x @ np.linspace(-1.0, 1.0, w.size)
    grad: np.ndarray = x.T @ (x @ w - target) / len(x)
    return grad


def main() -> None:
    """Runs the steps from where this worker's predecessor stopped (0 in a first process); prints the digest."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="clocks to run (default 30)")
    args = parser.parse_args()
    ctx = pt.init()
    kv = KVStore("bsp", optimizer={"name": "sgd", "lr": 0.5, "momentum": 0.9}, context=ctx, chunk_bytes=8192)
    kv.init("w", np.zeros(_SIZE))
    for step in range(kv.resumed_clock, args.steps):  # a replacement resumes at the interrupted clock
        kill_point(step + 1)  # paratrain launch --kill RANK@step=K fires here
        w = kv.pull("w")
        kv.push("w", _gradient(w, ctx.rank, step)).wait()
        kv.clock()
    w = kv.pull("w")
    digest = hashlib.sha256(w.tobytes()).hexdigest()[:16]
    print(f"worker {ctx.rank}: {args.steps} clocks (from {kv.resumed_clock}), parameters {digest}", flush=True)
    kv.close()
    pt.shutdown()


if __name__ == "__main__":
    main()
