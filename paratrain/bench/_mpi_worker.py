"""One rank of the OpenMPI anchor of ``paratrain bench allreduce``: ``Allreduce(IN_PLACE, buf, SUM)`` via mpi4py,
or (``--op``) ``Reduce``, ``Gather``, ``Scatter`` or ``Alltoall`` of the same buffers as paratrain's.

Started under ``mpirun`` by the benchmark; writes ``mpi-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._exit import exit_with
from paratrain.bench._timing import add_worker_args, progress_printer, record_result, run_sizes, start_watchdog


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

    def make(buf: npt.NDArray[np.float32]) -> Callable[[], Any]:
        block = buf.size // world if args.op in ("scatter", "alltoall") else buf.size
        out = np.empty(world * block if args.op in ("gather", "alltoall") else block, dtype=np.float32)
        root_out = out if rank == 0 else None
        calls: dict[str, Callable[[], None]] = {
            "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
            "reduce": lambda: comm.Reduce(buf, root_out, op=MPI.SUM, root=0),
            "gather": lambda: comm.Gather(buf, root_out, root=0),
            "scatter": lambda: comm.Scatter(buf if rank == 0 else None, out, root=0),
            "alltoall": lambda: comm.Alltoall(buf, out),
        }
        call = calls[args.op]

        def op() -> Any:
            call()
            return None if args.op == "allreduce" else out

        return op

    def measure() -> list[dict[str, Any]]:
        progress = progress_printer("mpi", rank)
        return run_sizes(args, rank=rank, world_size=world, make_op=make, barrier=comm.Barrier, progress=progress)

    return record_result(args.out, "mpi", rank, payload, measure)


if __name__ == "__main__":
    exit_with(main)
