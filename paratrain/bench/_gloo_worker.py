"""One rank of the Gloo anchor of ``paratrain bench allreduce``: ``torch.distributed.all_reduce`` on float32.

Started by the benchmark itself (one process per rank, ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``
in the environment); writes ``gloo-rank{r}.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._exit import exit_with
from paratrain.bench._timing import add_worker_args, progress_printer, record_result, run_sizes, start_watchdog


def main(argv: list[str] | None = None) -> int:
    """Joins the Gloo group, times ``all_reduce`` on every size, writes the result; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__)
    add_worker_args(parser)
    args = parser.parse_args(argv)
    start_watchdog(args.deadline, "gloo bench worker")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def measure() -> list[dict[str, Any]]:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=max(args.deadline, 1.0))
        )

        def make(buf: npt.NDArray[np.float32]) -> Callable[[], None]:
            tensor = torch.from_numpy(buf)  # shares memory: the check and the zeroing act on the tensor
            return lambda: dist.all_reduce(tensor)

        progress = progress_printer("gloo", rank)
        results = run_sizes(args, rank=rank, world_size=world, make_op=make, barrier=dist.barrier, progress=progress)
        dist.destroy_process_group()
        return results

    return record_result(args.out, "gloo", rank, {"world_size": world}, measure)


if __name__ == "__main__":
    exit_with(main)
