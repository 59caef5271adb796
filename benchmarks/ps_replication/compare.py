"""Prints replication's cost from the JSON files of run.sh: per size, replicas 2 / replicas 1 for each round.

Usage: ``python benchmarks/ps_replication/compare.py DIR`` (DIR holds ``replicas{1,2}-run{i}.json``). A round's
ratio pairs the two runs made one after the other, so that a slow period of a shared machine cancels out; the
table gives the median over rounds and the smallest and largest ratio (the spread).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _means(path: Path) -> dict[str, tuple[float, dict[str, float]]]:
    report = json.loads(path.read_text())
    return {r["size"]: (r["mean_ms"], r.get("phases_ms", {})) for r in report["results"] if r["engine"] == "ps"}


def main(directory: str) -> None:
    root = Path(directory)
    rounds = sorted(int(p.stem.split("run")[1]) for p in root.glob("replicas1-run*.json"))
    pairs = [(_means(root / f"replicas1-run{i}.json"), _means(root / f"replicas2-run{i}.json")) for i in rounds]
    head = f"{'size':>8} {'r1 ms (median)':>15} {'r2 ms (median)':>15} {'ratio median':>12} {'min':>6} {'max':>6}"
    print(head + "  per round")
    for size in pairs[0][0]:
        one = [p[0][size][0] for p in pairs]
        two = [p[1][size][0] for p in pairs]
        ratios = [b / a for a, b in zip(one, two, strict=True)]
        print(
            f"{size:>8} {statistics.median(one):>15.2f} {statistics.median(two):>15.2f} "
            f"{statistics.median(ratios):>11.2f}x {min(ratios):>5.2f}x {max(ratios):>5.2f}x  "
            + " ".join(f"{r:.2f}" for r in ratios)
        )
        for label, runs in (("r1", [p[0][size][1] for p in pairs]), ("r2", [p[1][size][1] for p in pairs])):
            phases = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            print(f"{'':>8} {label} phases ms (median): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))


if __name__ == "__main__":
    main(sys.argv[1])
