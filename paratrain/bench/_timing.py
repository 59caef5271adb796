"""The timing loop, result file and watchdog shared by every benchmark worker (paratrain, Gloo, MPI).

Every engine runs exactly this loop, so that the numbers differ only by the library under test: fill the buffer
with ``rank + 1``, run one operation and check the sum (a wrong result must never be reported as a time), zero
the buffer, run the warm-up operations, pass the engine's own barrier, then time ``iters`` operations back to
back, each one separately and all together.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["add_worker_args", "format_bytes", "parse_int_list", "run_sizes", "start_watchdog", "write_result"]


def add_worker_args(parser: Any) -> None:
    """The arguments every worker takes (``argparse.ArgumentParser``)."""
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--iters", required=True, help="comma-separated timed iterations, one per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed operations before timing (default 3)")
    parser.add_argument("--out", required=True, help="directory for the per-rank JSON result files")
    parser.add_argument("--deadline", type=float, default=300.0, help="exit with code 124 after this many s")


def start_watchdog(seconds: float, what: str) -> None:
    """Ends this process with exit code 124 after ``seconds``: a hung benchmark must not hang its caller."""

    def fire() -> None:
        print(f"{what}: still running after {seconds:.0f}s; giving up (exit 124)", file=sys.stderr, flush=True)
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def run_sizes(
    *,
    sizes: list[int],
    iters: list[int],
    warmup: int,
    rank: int,
    world_size: int,
    make_op: Callable[[npt.NDArray[np.float32]], Callable[[], None]],
    barrier: Callable[[], None],
    progress: Callable[[int, float], None] | None = None,
) -> list[dict[str, Any]]:
    """Times the operation that ``make_op(buffer)`` returns, for each size; returns one record per size.

    ``make_op`` receives a float32 numpy buffer of the size and returns a closure that allreduces it in place
    (the closure may wrap the buffer in a tensor once, outside the timed loop).

    Raises:
        RuntimeError: the verification allreduce gave a wrong sum.
    """
    records = []
    expected = world_size * (world_size + 1) / 2
    for nbytes, count in zip(sizes, iters, strict=True):
        buf = np.empty(nbytes // 4, dtype=np.float32)
        op = make_op(buf)
        buf.fill(rank + 1)
        op()
        if buf.size and not (buf[0] == expected and buf[-1] == expected and np.all(buf == expected)):
            raise RuntimeError(
                f"wrong allreduce result for {nbytes} bytes: got {buf[0]}..{buf[-1]}, expected {expected}"
            )
        buf.fill(0)
        for _ in range(warmup):
            op()
        barrier()
        perf = time.perf_counter
        times = []
        t0 = perf()
        for _ in range(count):
            start = perf()
            op()
            times.append(perf() - start)
        total = perf() - t0
        records.append({"bytes": nbytes, "iters": count, "total_s": total, "times_s": times})
        if progress is not None:
            progress(nbytes, total / max(count, 1))
    return records


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
