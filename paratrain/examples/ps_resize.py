"""A parameter-server job whose servers change while it trains: one joins, another leaves, no update is lost.

Run it with four server processes, two of which hold keys at the start::

    paratrain launch -n 2 --servers 4 -- python -m paratrain.examples.ps_resize

Every clock each worker adds 1 to every element of an integer key of ``--mib`` MiB (and of three small keys). At
clock ``--add-at`` worker 0 gives server 2 its share of the keys (``kv.add_server(2)``); at ``--remove-at`` worker
1 hands server 0's chunks to the others (``kv.remove_server(0)``). The chunks move while the workers go on: each
pauses once per resize, at its next call, until they moved (:mod:`paratrain.ps.resize`). At the end every element
must equal workers x clocks: an integer audit, exact or not at all. Each worker prints one JSON line: what the resizes
it asked for moved (chunks, bytes, seconds) and how long it paused at each. Only numpy is needed.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import paratrain as pt
from paratrain.ps import KVStore
from paratrain.ps.sharding import plan_chunks

_SMALL = {"bias": (4096,), "emb": (512, 64), "head": (256, 256)}


def main() -> None:
    """Trains ``--clocks`` clocks, resizing the servers twice; checks the sums; prints the measurements."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=16.0, help="size of the big key in MiB (default 16)")
    parser.add_argument("--clocks", type=int, default=12, help="clocks (default 12)")
    parser.add_argument("--active", type=int, default=2, help="servers holding keys at the start (default 2)")
    parser.add_argument("--add", type=int, default=2, help="the server to add (default 2)")
    parser.add_argument("--add-at", type=int, default=4, help="clock at which worker 0 adds it (default 4)")
    parser.add_argument("--remove", type=int, default=0, help="the server to remove (default 0); -1: none")
    parser.add_argument("--remove-at", type=int, default=8, help="clock at which worker 1 removes it (default 8)")
    parser.add_argument("--chunk-kib", type=int, default=256, help="chunk size in KiB (default 256)")
    parser.add_argument("--consistency", default="ssp", choices=["bsp", "ssp", "asp"], help="(default ssp)")
    args = parser.parse_args()

    pt.init(timeout=120)
    rank, workers = pt.rank(), pt.world_size()
    staleness = 1 if args.consistency == "ssp" else None
    kv = KVStore(args.consistency, staleness, active_servers=args.active, chunk_bytes=args.chunk_kib << 10)
    shapes = {"big": (int(args.mib * (1 << 20)) // 8,), **_SMALL}
    for key, shape in shapes.items():
        kv.init(key, np.zeros(shape, dtype=np.int64))
    ones = {key: np.ones(shape, dtype=np.int64) for key, shape in shapes.items()}
    resizes = []
    started = time.perf_counter()
    for clock in range(args.clocks):
        pushes = [kv.push(key, ones[key]) for key in shapes]
        if args.consistency == "asp":
            for push in pushes:
                push.wait()
        if rank == 0 and clock == args.add_at:
            resizes.append(("add", kv.add_server(args.add)))
        if rank == min(1, workers - 1) and clock == args.remove_at and args.remove >= 0:
            resizes.append(("remove", kv.remove_server(args.remove)))
        kv.clock()
    for _ in range(0 if args.consistency == "asp" else 2):  # every push counted before the last reads
        kv.clock()
    if args.consistency == "asp":
        pt.barrier()
    seconds = time.perf_counter() - started
    for key in shapes:
        value = kv.pull(key)
        if not (value == workers * args.clocks).all():
            raise SystemExit(f"worker {rank}: key {key!r} lost or repeated updates: {np.unique(value)}")
    done = [{"what": what, **handle.wait()} for what, handle in resizes]
    print(f"worker {rank}: every update counted once ({workers} workers x {args.clocks} clocks)", flush=True)
    report = {
        "rank": rank,
        "bytes": sum(int(np.prod(s)) * 8 for s in shapes.values()),
        "chunks": sum(
            len(plan_chunks(key, shape, 8, 1, chunk_bytes=args.chunk_kib << 10)) for key, shape in shapes.items()
        ),
        "seconds": round(seconds, 3),
        "active_at_end": list(kv.active_servers),
        "resizes": done,
        "pauses_s": [round(pause, 4) for _, pause in kv.resize_fences],
    }
    print(json.dumps(report), flush=True)
    kv.close()


if __name__ == "__main__":
    main()
