"""Does the staged path overlap the gradients' device-to-host copies with backward? (issue 19, on a GPU machine)

Two thread ranks share one GPU and train an MLP of wide layers with the DistributedOptimizer (allreduce, buckets of
16 MiB); three steps after a warm-up run under torch's profiler. From its trace: every device-to-host memcpy, and
how much of its time a compute kernel ran at the same time (on another stream). Staged in the background, the
copies of the last layers' buckets run while backward computes the first layers; staged synchronously in the hook
(the code before issue 19), no copy could overlap a kernel of the same thread's backward.

Prints one line per rank-less summary and writes the trace (chrome://tracing, Perfetto) and the numbers to $OUT.

    python benchmarks/gpu/overlap.py [OUT]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import paratrain.torch as ptt
from paratrain import Context
from paratrain.testing import run_ranks

WIDTH, LAYERS, BATCH, STEPS = 4096, 8, 256, 3


def train(ctx: Context, steps: int, start: Any, stop: Any) -> float:
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers).cuda()
    opt = ptt.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=1e-3), model=net, strategy="allreduce", bucket_bytes=16 << 20, context=ctx
    )
    x = torch.randn(BATCH, WIDTH, device="cuda")
    for step in range(2 + steps):
        if step == 2:
            ctx.barrier()
            start()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    ctx.barrier()
    stop()
    opt.close()
    return float(next(net.parameters()).detach().sum())


def overlap(trace: dict[str, Any]) -> dict[str, float]:
    """Device-to-host copies, and the part of their time during which a kernel ran on another stream."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    overlapped = total = 0.0
    for c in copies:
        lo, hi = c["ts"], c["ts"] + c["dur"]
        total += c["dur"]
        spans = sorted((max(lo, a), min(hi, b)) for a, b, tid in kernels if tid != c.get("tid") and a < hi and b > lo)
        covered, end = 0.0, lo
        for a, b in spans:
            if b > end:
                covered += b - max(a, end)
                end = b
        overlapped += covered
    return {
        "d2h_copies": len(copies),
        "d2h_us": total,
        "overlapped_us": overlapped,
        "overlapped_share": overlapped / total if total else 0.0,
    }


def main(out: Path) -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/overlap.py needs a CUDA device")
    out.mkdir(parents=True, exist_ok=True)
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    started: list[float] = []

    def start() -> None:
        if not started:  # rank 0's call (the ranks are threads of this process; the profiler is the process's)
            started.append(time.perf_counter())
            profiler.start()

    def stop() -> None:
        if len(started) == 1:
            started.append(time.perf_counter())
            profiler.stop()

    sums = run_ranks(2, lambda ctx: train(ctx, STEPS, start, stop), timeout=600)
    path = out / "overlap-trace.json"
    profiler.export_chrome_trace(str(path))
    result = {
        **overlap(json.loads(path.read_text())),
        "seconds_per_step": (started[1] - started[0]) / STEPS,
        "ranks_agree": sums[0] == sums[1],
        "device": torch.cuda.get_device_name(0),
    }
    (out / "overlap.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("gpu-overlap"))
