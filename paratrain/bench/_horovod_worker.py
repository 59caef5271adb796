"""One rank of the Horovod anchor of ``paratrain bench allreduce``: ``hvd.allreduce_(t, op=hvd.Sum)`` on float32.

Started under ``horovodrun --gloo`` by the benchmark (Horovod built from PyPI's source against this torch, see
``benchmarks/horovod/build.sh``); writes ``horovod-rank{r}.json`` into ``--out``. Horovod is optional: it is
imported by name, only here.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._exit import exit_with
from paratrain.bench._timing import add_worker_args, progress_printer, record_result, run_sizes, start_watchdog


def main(argv: list[str] | None = None) -> int:
    """Joins Horovod, times ``allreduce_`` (Sum, in place) on every size, writes the result; the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_worker_args(parser)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, "horovod bench worker")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd: Any = importlib.import_module("horovod.torch")
    hvd.init()
    rank, world = hvd.rank(), hvd.size()

    def measure() -> list[dict[str, Any]]:
        def make(buf: npt.NDArray[np.float32]) -> Callable[[], None]:
            tensor = torch.from_numpy(buf)  # shares memory: the check and the zeroing act on the tensor
            return lambda: hvd.allreduce_(tensor, op=hvd.Sum, name="bench")

        progress = progress_printer("horovod", rank)
        results = run_sizes(args, rank=rank, world_size=world, make_op=make, barrier=hvd.barrier, progress=progress)
        return results

    code = record_result(args.out, "horovod", rank, {"world_size": world}, measure)
    hvd.shutdown()
    return code


if __name__ == "__main__":
    exit_with(main)
