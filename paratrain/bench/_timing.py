"""The worker side of the harness: arguments, timing loop, progress lines, result file and watchdog.

Shared by every benchmark worker (paratrain, Gloo, MPI, the parameter server and its ceiling), so that workers
hold only what one operation of their engine is.

Every engine runs exactly this loop, so that the numbers differ only by the library under test: fill the buffer
(``rank + 1``; :mod:`._operations` for the collectives besides allreduce), run one operation and check its
result (a wrong result must never be reported as a time), zero an allreduce's buffer, run the warm-up
operations, pass the engine's own barrier, then time ``iters`` operations back to back, each one separately and
all together.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.bench._operations import check_result, send_buffer

__all__ = [
    "add_worker_args",
    "each_size",
    "format_bytes",
    "parse_int_list",
    "progress_printer",
    "record_result",
    "run_sizes",
    "start_watchdog",
    "write_result",
]

#: Rank 0's progress line per size: the label, the size, the time of one operation in this unit.
_UNITS = {"us/op": (1e6, "10.1f", 18), "ms/iteration": (1e3, "9.2f", 8)}


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every worker takes (the harness passes them: :func:`paratrain.bench.harness.worker_args`)."""
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--iters", required=True, help="comma-separated timed iterations, one per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed operations before timing (default 3)")
    parser.add_argument("--out", required=True, help="directory for the per-rank JSON result files")
    parser.add_argument("--deadline", type=float, default=300.0, help="exit with code 124 after this many s")
    parser.add_argument("--op", default="allreduce", help="the collective timed (run_sizes; default allreduce)")


def start_watchdog(seconds: float, what: str) -> None:
    """Ends this process with exit code 124 after ``seconds``: a hung benchmark must not hang its caller."""

    def fire() -> None:
        print(f"{what}: still running after {seconds:.0f}s; giving up (exit 124)", file=sys.stderr, flush=True)
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def progress_printer(label: str, rank: int, *, unit: str = "us/op") -> Callable[[int, float], None]:
    """Prints rank 0's line per size while the benchmark runs, e.g. ``    gloo    4 KiB:   208.0 us/op``.

    ``unit`` is ``"us/op"`` (collectives) or ``"ms/iteration"`` (parameter-server iterations).
    """
    scale, number, width = _UNITS[unit]

    def report(nbytes: int, seconds: float) -> None:
        if rank == 0:
            print(f"    {label:<{width}} {format_bytes(nbytes):>9}: {seconds * scale:{number}} {unit}", flush=True)

    return report


def each_size(
    args: argparse.Namespace,
    measure: Callable[[int, int], dict[str, Any]],
    progress: Callable[[int, float], None] | None = None,
) -> list[dict[str, Any]]:
    """Calls ``measure(nbytes, iters)`` for every size of ``--sizes``/``--iters``; its records, in order.

    A record holds at least ``total_s``, the time of the ``iters`` timed iterations, which ``progress`` gets
    per iteration.
    """
    records = []
    for nbytes, iters in zip(parse_int_list(args.sizes), parse_int_list(args.iters), strict=True):
        record = measure(nbytes, iters)
        records.append(record)
        if progress is not None:
            progress(nbytes, record["total_s"] / max(iters, 1))
    return records


def record_result(
    out_dir: str, engine: str, rank: int, payload: dict[str, Any], measure: Callable[[], list[dict[str, Any]]]
) -> int:
    """Runs ``measure`` and writes this rank's result file with its records, or with why it failed; the exit code.

    Why a failure still writes a file: the harness then reports the engine's own error ("RuntimeError: wrong
    allreduce result ...") instead of "rank 1 wrote no result".
    """
    try:
        payload.update({"status": "ok", "results": measure()})
        code = 0
    except Exception as exc:
        payload.update({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        print(f"rank {rank}: {engine} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    write_result(out_dir, engine, rank, payload)
    return code


def run_sizes(
    args: argparse.Namespace,
    *,
    rank: int,
    world_size: int,
    make_op: Callable[[npt.NDArray[np.float32]], Callable[[], Any]],
    barrier: Callable[[], None],
    progress: Callable[[int, float], None] | None = None,
) -> list[dict[str, Any]]:
    """Times the operation that ``make_op(buffer)`` returns, for each size of ``args``; one record per size.

    ``make_op`` receives the float32 numpy buffer this rank passes to ``args.op`` (allreduce by default:
    :func:`~paratrain.bench._operations.send_buffer`) and returns a closure that runs the collective on it
    and returns its result (allreduce: in place; the closure may wrap the buffer in a tensor once, outside the
    timed loop).

    Raises:
        RuntimeError: the verification call gave a wrong result.
    """
    op_name = getattr(args, "op", "allreduce")
    perf = time.perf_counter

    def one(nbytes: int, count: int) -> dict[str, Any]:
        buf = send_buffer(op_name, nbytes, rank, world_size)
        op = make_op(buf)
        check_result(op_name, op(), buf, rank=rank, world=world_size, nbytes=nbytes)
        if op_name == "allreduce":
            buf.fill(0)  # (in place: repeated sums of zeros stay finite)
        for _ in range(args.warmup):
            op()
        barrier()
        times = []
        t0 = perf()
        for _ in range(count):
            start = perf()
            op()
            times.append(perf() - start)
        total = perf() - t0
        return {"bytes": nbytes, "iters": count, "total_s": total, "times_s": times}

    return each_size(args, one, progress)


def write_result(out_dir: str, engine: str, rank: int, payload: dict[str, Any]) -> None:
    """Writes ``payload`` to ``out_dir/{engine}-rank{rank}.json`` atomically (a reader never sees half)."""
    path = os.path.join(out_dir, f"{engine}-rank{rank}.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"engine": engine, "rank": rank, **payload}, fh)
    os.replace(tmp, path)


def parse_int_list(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``."""
    return [int(part) for part in text.split(",") if part]


def format_bytes(nbytes: int) -> str:
    """A size for people: ``4096`` -> ``"4 KiB"``, ``1000`` -> ``"1000 B"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
