"""One worker of ``paratrain bench recovery --server``: a replicated parameter-server job whose server 0 is killed.

Run as ``paratrain launch -n W --servers 2 --replicas 2 --max-restarts 1``. Every worker trains one float32 key of
``--size`` elements with the servers' Adam (so a server holds three arrays of that size) under BSP; worker 0
SIGKILLs server 0 as clock ``--kill-clock`` begins. The launcher restarts it and it catches up
(:mod:`paratrain.ps.resync`). The workers stop together (an allreduce among them) once each has fenced the
restarted server and run ``--min-clocks``. Each writes ``restart-rank{r}.json`` into ``--out``: the death
(``time.time()``), when its first push after it was acknowledged by the backup (failover), when it saw the
restarted server back and how long its fence paused it.

``--ceiling`` instead times the transport alone moving the same bytes one way between two processes (rank 1 to
rank 0, as a donor's snapshot goes), on the sender: from its send to an empty answer (one small message more than
the transfer): ``paratrain launch -n 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path

import numpy as np

import paratrain as pt
from paratrain._exit import exit_with
from paratrain.ps import KVStore

__all__ = ["server_pid"]


def server_pid(index: int) -> int:
    """The pid of this job's parameter-server process ``index`` (a test's and a benchmark's way to kill one at an
    exact clock): found by its environment, as the launcher set it."""
    run_id = os.environ["PARATRAIN_RUN_ID"].encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if (
            env.get(b"PARATRAIN_RUN_ID") == run_id
            and env.get(b"PARATRAIN_ROLE") == b"server"
            and env.get(b"RANK") == str(index).encode()
        ):
            return int(entry)
    raise SystemExit(f"server {index} of this job not found")


def _job(args: argparse.Namespace) -> None:
    ctx = pt.init()
    # 16 chunks, so that both servers own some (the killed one's fail over) whatever the size
    kv = KVStore("bsp", optimizer={"name": "adam", "lr": 1e-3}, context=ctx, chunk_bytes=max(4096, args.size // 4))
    kv.init("w", np.zeros(args.size, dtype=np.float32))
    started = time.time()
    killed = failover = None
    clocks = 0
    while True:
        w = kv.pull("w")
        pushed = kv.push("w", np.sin(w + np.float32(clocks + ctx.rank)))
        if ctx.rank == 0 and clocks == args.kill_clock:
            killed = time.time()
            os.kill(server_pid(0), signal.SIGKILL)
        pushed.wait(60)
        if failover is None and kv.failovers:
            failover = time.time()
        kv.clock()
        clocks += 1
        more = clocks < args.min_clocks or (not kv.resyncs and time.time() - started < args.patience)
        if pt.allreduce(np.array([float(more)]), op="max")[0] == 0:
            break
    record = {"rank": ctx.rank, "clocks": clocks, "killed": killed, "failover": failover, "fences": kv.fences}
    Path(args.out, f"restart-rank{ctx.rank}.json").write_text(json.dumps(record))
    kv.close()
    pt.shutdown()


def _ceiling(args: argparse.Namespace) -> None:
    ctx = pt.init()
    t = ctx.transport
    data = np.ones(args.size, dtype=np.float32)
    times = []
    for i in range(args.repeat + 1):
        pt.barrier()
        begun = time.perf_counter()
        if ctx.rank == 1:
            t.send(0, 1, [data], {"i": i})
            t.recv(0, 2)
        else:
            t.recv(1, 1)
            t.send(1, 2)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - begun)
    # The sender's round trip, the data out and an empty answer back: the receiver's clock starts when it leaves the
    # barrier, possibly after the sender has already written the message (a shared-memory lane's copy is the
    # sender's), so it could leave out part of the transfer.
    if ctx.rank == 1:
        record = {"bytes": data.nbytes, "seconds": statistics.median(times), "min": min(times), "max": max(times)}
        Path(args.out, f"ceiling-{args.size}.json").write_text(json.dumps(record))
    pt.shutdown()


def main() -> None:
    """One worker (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", type=int, required=True, help="float32 elements of the key")
    parser.add_argument("--kill-clock", type=int, default=10)
    parser.add_argument("--min-clocks", type=int, default=30)
    parser.add_argument("--patience", type=float, default=60.0, help="seconds to wait for the restart at most")
    parser.add_argument("--ceiling", action="store_true", help="time the transport alone (see the docstring)")
    parser.add_argument("--repeat", type=int, default=5, help="(--ceiling) transfers to time")
    args = parser.parse_args()
    (_ceiling if args.ceiling else _job)(args)


if __name__ == "__main__":
    exit_with(main)
