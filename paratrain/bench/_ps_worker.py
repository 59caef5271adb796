"""One worker of ``paratrain bench ps``'s parameter-server engine; run under ``paratrain launch --servers S``.

Each worker makes a :class:`~paratrain.ps.KVStore`, initialises one float32 key per size (the store cuts it
into chunks over the servers), checks one push/clock/pull round against the exact sum (a wrong result must
never be reported as a time), warms up, passes a barrier of the workers, then times ``iters`` iterations of
``push(key, grad)`` + ``clock()`` + ``pull(key, out=buf)``, one by one and all together, with the time of each phase.
It writes ``ps-rank{r}.json`` into ``--out``. The loop itself (:func:`time_iterations`) is shared with the
ceiling engine (:mod:`._ps_ceiling_worker`), so that the two differ only by what one iteration does.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from paratrain._exit import exit_with
from paratrain.bench._timing import add_worker_args, each_size, progress_printer, record_result, start_watchdog
from paratrain.ps.sharding import plan_chunks
from paratrain.strategy import parse_strategy

__all__ = ["add_args", "main", "time_iterations"]

#: One iteration's phases: a callable per phase, run in order; the loop times each of them.
Phases = Sequence[tuple[str, Callable[[], object]]]


def add_args(parser: argparse.ArgumentParser) -> None:
    """The arguments both PS-benchmark workers take: every worker's, and the number of servers."""
    add_worker_args(parser)
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
    buf = np.empty(nbytes // 4, dtype=np.float32)  # reused, as a training loop reuses its parameters
    pending: list[Any] = []
    pulled: list[Any] = [None]

    def push() -> None:
        pending.append(kv.push(key, grad))

    def pull() -> None:
        pulled[0] = kv.pull(key, out=buf)
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
    spec = parse_strategy(args.consistency)
    payload: dict[str, Any] = {"world_size": ctx.world_size, "servers": args.servers, "consistency": args.consistency}

    def measure() -> list[dict[str, Any]]:
        with pt.ps.KVStore(consistency=spec.kind, staleness=spec.staleness, context=ctx) as kv:
            return each_size(
                args,
                lambda nbytes, iters: _measure_size(
                    ctx, kv, nbytes, iters=iters, warmup=args.warmup, consistency=spec.kind
                ),
                progress_printer("ps", ctx.rank, unit="ms/iteration"),
            )

    code = record_result(args.out, "ps", ctx.rank, payload, measure)
    pt.shutdown()
    return code


if __name__ == "__main__":
    exit_with(main)
