"""Median step time after the first step (compute + wait of the slowest rank in each step), per strategy.

Usage: ``python benchmarks/poseidon/steps.py DIR`` with DIR a ``paratrain compare --out DIR`` directory. The
first step also opens connections and (PowerSGD in DDP, not here) may run uncompressed, so ``compare``'s
samples/s over 8 steps understates the steady state; this is the number to set beside DDP's median step.
Prints the median over rounds of each round's median, and the smallest and largest round.
"""
import json
import pathlib
import statistics
import sys

root = pathlib.Path(sys.argv[1])
for d in sorted(p for p in root.iterdir() if p.is_dir()):
    meds = []
    for rd in sorted(d.glob("round*")) or [d]:
        per_step = {}
        for f in rd.glob("rank*.metrics.jsonl"):
            for line in f.read_text().splitlines():
                r = json.loads(line)
                if r.get("kind") == "step":
                    per_step.setdefault(r["step"], []).append(r["compute_s"] + r["wait_s"])
        steps = [max(v) for k, v in sorted(per_step.items()) if k > 1]
        if steps:
            meds.append(statistics.median(steps))
    if meds:
        meds.sort()
        print(f"{d.name:32s} median step after the first: {statistics.median(meds):.3f} s ({meds[0]:.3f}-{meds[-1]:.3f}) -> {256/statistics.median(meds):.0f} samples/s")
