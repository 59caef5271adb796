"""A replicated parameter-server job whose dead server is restarted and catches up while the workers go on.

Run it with a failure on purpose::

    paratrain launch -n 2 --servers 2 --replicas 2 --max-restarts 1 --kill server0@2s \\
        -- python -m paratrain.examples.ps_restart

Server 0 is killed 2 s in. Its chunks fail over to server 1 (each lives on both), the launcher restarts it, and
the restarted process catches up: every worker pauses once at a fence, server 1 sends it a copy of the chunks
they share (values, optimizer state, open rounds) and the workers' clocks, and it is a backup again
(:mod:`paratrain.ps.resync`). The job runs at least ``--steps`` clocks, and with ``--until-caught-up`` (the
default) on until every worker has seen a restarted server catch up, so the fault fires while it runs.

Two keys: ``w``, to which every worker adds a step that depends on what it read (values whose sums are exact),
and ``n``, to which every worker adds 1 per clock (an audit: no push lost or applied twice). At the end every
worker prints the clocks run, the servers it fenced for, whether both replicas of each key agree bitwise, and
whether ``n`` is exact. Only numpy is needed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import paratrain as pt
from paratrain.ps import KVStore

_SIZE = 1024


def main() -> None:
    """Runs the clocks; prints this worker's view of the job and the replicas' agreement."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="clocks to run at least (default 200)")
    parser.add_argument(
        "--no-wait",
        dest="until_caught_up",
        action="store_false",
        help="stop after --steps even if no restarted server has caught up yet",
    )
    parser.add_argument(
        "--patience", type=float, default=60.0, help="seconds to go on waiting for a restart (default 60)"
    )
    args = parser.parse_args()
    ctx = pt.init()
    kv = KVStore("bsp", context=ctx, chunk_bytes=2048)
    kv.init("w", np.linspace(-1.0, 1.0, _SIZE))
    kv.init("n", np.zeros(_SIZE + 1, dtype=np.int64))  # the last element: the clock at which everyone stops
    started = time.monotonic()
    clocks, said = 0, False
    while True:
        w = kv.pull("w")
        kv.push("w", np.floor(np.sin(w * (ctx.rank + 1) + clocks) * 8) / 8)  # dyadic: every sum is exact
        enough = clocks + 1 >= args.steps and (
            not args.until_caught_up or kv.resyncs > 0 or time.monotonic() - started > args.patience
        )
        push = np.ones(_SIZE + 1, dtype=np.int64)
        push[-1] = 0
        if ctx.rank == 0 and enough and not said:  # rank 0 decides: stop two clocks on, so that every worker's
            push[-1], said = clocks + 2, True  # read after the next clock shows it (BSP) and all stop alike
        kv.push("n", push)
        kv.clock()
        clocks += 1
        stop = kv.pull("n")[-1]
        if stop and clocks >= stop:
            break
    n = kv.pull("n")[:-1]
    agree = all(_agree(kv.pull_replicas(key)) for key in ("w", "n"))
    exact = bool(np.all(n == clocks * ctx.world_size))
    print(
        f"worker {ctx.rank}: {clocks} clocks, restarted servers caught up {kv.resyncs}, failovers {kv.failovers}, "
        f"replicas {'agree' if agree else 'DIFFER'}, counts {'exact' if exact else 'WRONG'}",
        flush=True,
    )
    kv.close()
    pt.shutdown()


def _agree(copies: list[np.ndarray]) -> bool:
    return all(np.array_equal(copies[0], c) for c in copies[1:])


if __name__ == "__main__":
    main()
