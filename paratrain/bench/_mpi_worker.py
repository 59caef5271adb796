"""One rank of the OpenMPI anchor of ``paratrain bench allreduce``: ``Allreduce(IN_PLACE, buf, SUM)`` via mpi4py.

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

    def make(buf: npt.NDArray[np.float32]) -> Callable[[], None]:
        return lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def measure() -> list[dict[str, Any]]:
        progress = progress_printer("mpi", rank)
        return run_sizes(args, rank=rank, world_size=world, make_op=make, barrier=comm.Barrier, progress=progress)

    return record_result(args.out, "mpi", rank, payload, measure)


if __name__ == "__main__":
    exit_with(main)
