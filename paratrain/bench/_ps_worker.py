"""One worker of ``paratrain bench ps``'s parameter-server engine; run under ``paratrain launch --servers S``.

Each worker makes a :class:`~paratrain.ps.KVStore`, initialises one float32 key per size (the store cuts it
into chunks over the servers), checks one push/clock/pull round against the exact sum (a wrong result must
never be reported as a time), warms up, passes a barrier of the workers, then times ``iters`` iterations of
``push(key, grad)`` + ``clock()`` + ``pull(key)``, one by one and all together, with the time of each phase.
It writes ``ps-rank{r}.json`` into ``--out``. The loop itself (:func:`time_iterations`) is shared with the
ceiling engine (:mod:`._ps_ceiling_worker`), so that the two differ only by what one iteration does.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from paratrain.bench._timing import format_bytes, parse_int_list, start_watchdog, write_result
from paratrain.ps.sharding import plan_chunks

__all__ = ["add_args", "main", "time_iterations"]

#: One iteration's phases: a callable per phase, run in order; the loop times each of them.
Phases = Sequence[tuple[str, Callable[[], object]]]


def add_args(parser: argparse.ArgumentParser) -> None:
    """The arguments both PS-benchmark workers take."""
    parser.add_argument("--sizes", required=True, help="comma-separated key sizes in bytes (multiples of 4)")
    parser.add_argument("--iters", required=True, help="comma-separated timed iterations, one per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before timing (default 3)")
    parser.add_argument("--out", required=True, help="directory for the per-rank JSON result files")
    parser.add_argument("--deadline", type=float, default=300.0, help="exit with code 124 after this many s")
    parser.add_argument("--servers", type=int, required=True, help="number of servers S the key is split over")


def time_iterations(phases: Phases, *, iters: int, warmup: int, barrier: Callable[[], None]) -> dict[str, Any]:
    """Runs ``warmup`` untimed iterations, ``barrier()``, then times ``iters`` iterations of ``phases``.

    Returns ``{"iters", "total_s", "times_s", "phases_s"}``: the wall time of the whole timed loop, of every
    iteration, and the summed time of each phase over the loop (where an iteration's time goes).
    """
    for _ in range(warmup):
        for _, fn in phases:
            fn()
    barrier()
    perf = time.perf_counter
    times: list[float] = []
    spent = dict.fromkeys((name for name, _ in phases), 0.0)
    t0 = perf()
    for _ in range(iters):
        start = mark = perf()
        for name, fn in phases:
            fn()
            now = perf()
            spent[name] += now - mark
            mark = now
        times.append(mark - start)
    total = perf() - t0
    return {"iters": iters, "total_s": total, "times_s": times, "phases_s": spent}


def _measure_size(ctx: Any, kv: Any, nbytes: int, *, iters: int, warmup: int, consistency: str) -> dict[str, Any]:
    key = f"bench-{nbytes}"
    workers = ctx.world_size
    kv.init(key, np.zeros(nbytes // 4, dtype=np.float32))
    grad = np.full(nbytes // 4, ctx.rank + 1, dtype=np.float32)
    pending: list[Any] = []
    pulled: list[Any] = [None]

    def push() -> None:
        pending.append(kv.push(key, grad))

    def pull() -> None:
        pulled[0] = kv.pull(key)
        for handle in pending:  # long done (the pull was answered after them); surfaces a rejected push
            handle.wait(kv.timeout)
        pending.clear()

    phases: Phases = [("push", push), ("clock", kv.clock), ("pull", pull)]
    for _, fn in phases:  # the checked round: under BSP the pull must see exactly every worker's push
        fn()
    expected = workers * (workers + 1) / 2
    value = pulled[0]
    if consistency == "bsp" and value.size and not np.all(value == expected):
        raise RuntimeError(f"wrong PS result for {nbytes} bytes: got {value[0]}..{value[-1]}, expected {expected}")
    ctx.barrier()  # every worker's check is done before the values move on
    record = time_iterations(phases, iters=iters, warmup=warmup, barrier=ctx.barrier)
    chunks = plan_chunks(key, (nbytes // 4,), 4, kv.num_servers)
    record.update({"bytes": nbytes, "chunks": len(chunks), "servers_used": len({c.server for c in chunks})})
    return record


def main(argv: list[str] | None = None) -> int:
    """Times the PS on every size; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    parser.add_argument("--consistency", default="bsp", help="bsp, asp or ssp:S (default bsp)")
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, "paratrain bench ps worker")

    import paratrain as pt

    ctx = pt.init()
    kind, _, bound = args.consistency.partition(":")
    payload: dict[str, Any] = {"world_size": ctx.world_size, "servers": args.servers, "consistency": args.consistency}
    code = 0
    try:
        with pt.ps.KVStore(consistency=kind, staleness=int(bound) if bound else None, context=ctx) as kv:
            results = []
            for nbytes, iters in zip(parse_int_list(args.sizes), parse_int_list(args.iters), strict=True):
                record = _measure_size(ctx, kv, nbytes, iters=iters, warmup=args.warmup, consistency=kind)
                results.append(record)
                if ctx.rank == 0:
                    mean = record["total_s"] / max(iters, 1)
                    print(f"    ps       {format_bytes(nbytes):>9}: {mean * 1e3:9.2f} ms/iteration", flush=True)
        payload.update({"status": "ok", "results": results})
    except Exception as exc:
        code = 1
        payload.update({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        print(f"rank {ctx.rank}: ps benchmark failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    write_result(args.out, "ps", ctx.rank, payload)
    pt.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
