"""One rank of ``paratrain bench scaling --check``: times ``pt.allreduce_`` with each algorithm, under whatever
network the launcher gave it (the fault injector's links); every rank writes ``scaling-check-rank{r}.json``
into ``--out``.

Every call starts together (a barrier first), as the simulated exchange starts every rank at time 0. Each rank
keeps its own time of every call; the caller takes, per call, the slowest rank's (a root that returns once its
last send is queued has not finished the collective), as the simulated makespan is the last rank's finish.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from paratrain._exit import exit_with


def main(argv: list[str] | None = None) -> int:
    """Runs the timed calls; returns the exit code."""
    import paratrain as pt
    from paratrain.bench._timing import start_watchdog

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, required=True, help="float32 items per rank")
    parser.add_argument("--algorithms", required=True, help="comma-separated allreduce algorithms")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per algorithm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--out", required=True, help="the directory rank 0 writes its result into")
    parser.add_argument("--deadline", type=float, default=300.0, help="exit with code 124 after this many s")
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, "paratrain bench scaling --check")
    ctx = pt.init()
    try:
        buf = np.ones(args.count, dtype=np.float32)
        result = {}
        for algorithm in args.algorithms.split(","):
            times = []
            for i in range(args.warmup + args.iters):
                ctx.barrier()
                t0 = time.perf_counter()
                pt.allreduce_(buf, op="sum", algorithm=algorithm)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
                buf.fill(1.0)
            result[algorithm] = times
        ctx.barrier()
        out = pathlib.Path(args.out) / f"scaling-check-rank{ctx.rank}.json"
        out.write_text(json.dumps({"world_size": ctx.world_size, "count": args.count, "times_s": result}))
    finally:
        ctx.shutdown()
    return 0


if __name__ == "__main__":
    exit_with(main)
