"""One rank of the OpenMPI anchor of ``paratrain bench allreduce``: ``Allreduce(IN_PLACE, buf, SUM)`` via mpi4py.

Started under ``mpirun`` by the benchmark; writes ``mpi-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.bench._timing import (
    add_worker_args,
    format_bytes,
    parse_int_list,
    run_sizes,
    start_watchdog,
    write_result,
)


def main(argv: list[str] | None = None) -> int:
    """Times ``comm.Allreduce`` on every size and writes the result; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_worker_args(parser)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, "mpi bench worker")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    payload: dict[str, Any] = {"world_size": world, "library": MPI.Get_library_version().strip().splitlines()[0]}
    code = 0
    try:

        def make(buf: npt.NDArray[np.float32]) -> Callable[[], None]:
            return lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def progress(nbytes: int, seconds: float) -> None:
            if rank == 0:
                print(f"    {'mpi':<18} {format_bytes(nbytes):>9}: {seconds * 1e6:10.1f} us/op", flush=True)

        payload["results"] = run_sizes(
            sizes=parse_int_list(args.sizes),
            iters=parse_int_list(args.iters),
            warmup=args.warmup,
            rank=rank,
            world_size=world,
            make_op=make,
            barrier=comm.Barrier,
            progress=progress,
        )
        payload["status"] = "ok"
    except Exception as exc:
        payload["status"] = "error"
        payload["error"] = f"{type(exc).__name__}: {exc}"
        print(f"mpi rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    write_result(args.out, "mpi", rank, payload)
    return code


if __name__ == "__main__":
    sys.exit(main())
