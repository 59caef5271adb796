"""Every rank joins the job, passes N barriers, and prints one line: the demo of ``paratrain demo``.

Run: ``paratrain launch -n 4 -- python -m paratrain.examples.barriers [--barriers 10]``
"""

from __future__ import annotations

import argparse
import socket
import time

import paratrain as pt


def main() -> None:
    """Joins, passes the barriers, reports, leaves."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--barriers", type=int, default=10, help="number of barriers to pass (default 10)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    pt.init()
    t_init = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(args.barriers):
        pt.barrier()
    t_bar = time.perf_counter() - t1
    print(
        f"rank {pt.rank()} of {pt.world_size()} on {socket.gethostname()}: init {t_init * 1e3:.1f} ms, "
        f"{args.barriers} barriers in {t_bar * 1e3:.2f} ms ({t_bar / max(args.barriers, 1) * 1e6:.0f} us each)",
        flush=True,
    )
    pt.shutdown()


if __name__ == "__main__":
    main()
