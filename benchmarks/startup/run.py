"""Times a whole job — launch 4 ranks, init, 10 barriers, exit — for paratrain and for torchrun + Gloo.

Usage: python benchmarks/startup/run.py [--repeats 7] [--nproc 4]
Both commands run alternately in this one process, on the same machine, and the medians are compared.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    n = str(args.nproc)
    commands = {
        "paratrain launch + init + 10 barriers": [
            sys.executable, "-m", "paratrain.cli.main", "launch", "-n", n, "--",
            "python", "-m", "paratrain.examples.barriers", "--barriers", "10",
        ],
        "torchrun + Gloo init + 10 barriers": [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", n, "--master-port", "29577",
            str(HERE / "torch_barriers.py"),
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, cmd in commands.items():
            times[name].append(timed(cmd))
    anchor = statistics.median(times["torchrun + Gloo init + 10 barriers"])
    print(f"{'job (' + n + ' ranks)':<42} {'median s':>9} {'min s':>7} {'max s':>7} {'vs torch':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<42} {med:9.2f} {min(ts):7.2f} {max(ts):7.2f} {anchor / med:8.2f}x")


if __name__ == "__main__":
    main()
