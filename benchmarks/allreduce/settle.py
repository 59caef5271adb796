"""The public API and the raw shared-memory group, timed alternately in one job: how long each takes to settle.

Run: ``N=262144 ROUNDS=4 ORDER=api,raw .venv/bin/paratrain launch -n 4 benchmarks/allreduce/settle.py`` (N float32
elements; ORDER: which paths, in turn; each measurement is 5 untimed calls, a barrier and 30 timed calls; SLEEP=s
idles that long after init first). Rank 0 prints the mean ms per call of each measurement.
"""

import os
import time
from collections.abc import Callable

import numpy as np

import paratrain as pt
from paratrain.collectives.shm import ShmGroup


def timed(call: Callable[[], object], barrier: Callable[[], object], iters: int = 30) -> float:
    """Mean ms per call of ``iters`` calls, after 5 untimed ones and a barrier."""
    for _ in range(5):
        call()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    ctx = pt.init()
    if os.environ.get("SLEEP"):
        time.sleep(float(os.environ["SLEEP"]))
    n = int(os.environ.get("N", str(4 << 20)))
    group = None
    for _ in range(int(os.environ.get("ROUNDS", "2"))):
        for what in os.environ.get("ORDER", "api,raw").split(","):
            buf = np.empty(n, dtype=np.float32)
            buf.fill(ctx.rank + 1)
            if what == "api":
                pt.allreduce_(buf)
                buf.fill(0)
                ms = timed(lambda b=buf: pt.allreduce_(b, op="sum"), ctx.barrier)
            else:
                group = group or ShmGroup.from_context(ctx)
                group.allreduce_(buf, "sum")
                buf.fill(0)
                ms = timed(lambda b=buf, g=group: g.allreduce_(b, "sum"), group.barrier)
            if ctx.rank == 0:
                print(f"{what} {ms:.2f} ms", flush=True)
    if group is not None:
        group.close()
    pt.shutdown()


if __name__ == "__main__":
    main()
