"""Numbers read off the profiler traces of a ``run.sh`` visit (the traces.tar.gz it writes), for the README.

Per trace: how long a parameter's gradient hook kept autograd's thread (``torch::autograd::AccumulateGrad``, which
runs the post-accumulate hooks: paratrain's Python hook, or nothing for plain torch and DDP, whose C++ hooks run
outside it), the GPU's busy share (the union of kernels, copies and memsets over the span of GPU activity), and
the copies by kind; for the overlap trace, the device-to-host copies' sizes.

    python benchmarks/gpu/trace_stats.py TRACES.tar.gz OUT.json
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def stats(trace: dict[str, Any]) -> dict[str, Any]:
    """The figures of one Chrome trace of torch's profiler."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    hooks = [e["dur"] for e in events if e["name"] == "torch::autograd::AccumulateGrad"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES)
    busy, end = 0.0, spans[0][0] if spans else 0.0
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    wall = (max(b for _, b in spans) - spans[0][0]) if spans else 0.0
    copies = collections.Counter(e["name"] for e in events if e.get("cat") == "gpu_memcpy")
    d2h = sorted({round(e.get("args", {}).get("bytes", 0) / 2**20, 3) for e in events if "DtoH" in e["name"]})
    return {
        "accumulate_grad_us": {
            "count": len(hooks),
            "median": statistics.median(hooks) if hooks else None,
            "mean": statistics.mean(hooks) if hooks else None,
        },
        "gpu_busy_share": busy / wall if wall else None,
        "gpu_wall_us": wall,
        "copies": dict(copies),
        "d2h_sizes_mib": d2h,
    }


def main(archive: Path, out: Path) -> None:
    report: dict[str, Any] = {}
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and member.name.endswith(".json"):
                handle = tar.extractfile(member)
                assert handle is not None
                report[Path(member.name).stem] = stats(json.load(handle))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
