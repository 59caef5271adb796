"""Does the staged path overlap the gradients' device-to-host copies with backward? (issues 19 and 42, on a GPU)

Two thread ranks share one GPU and train an MLP of wide layers with the DistributedOptimizer (allreduce, buckets of
16 MiB); three steps after a warm-up run under torch's profiler, which the main thread starts and stops once for
the whole process (the ranks wait at a barrier meanwhile: Kineto must start and stop in one thread, and only once
per process). CUPTI records every rank's kernels and copies. From the trace: every device-to-host memcpy, and how
much of its time a compute kernel ran at the same time on another stream. Staged in the background, the copy of
a layer's bucket runs while backward computes the layers before it; staged synchronously in the hook, no copy
could overlap a kernel of the same rank's backward.

Prints one JSON line and writes the trace (chrome://tracing, Perfetto) and the numbers to OUT.

    python benchmarks/gpu/overlap.py [OUT]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import paratrain.torch as ptt
from paratrain import Context
from paratrain.testing import run_ranks

WIDTH, LAYERS, BATCH, STEPS = 4096, 8, 256, 3
GATE_TIMEOUT = 300.0


def train(ctx: Context, steps: int, gate: threading.Barrier) -> float:
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers).cuda()
    ptt.broadcast_parameters(net, context=ctx)  # (the thread ranks drew different weights from torch's one generator)
    opt = ptt.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=1e-3), model=net, strategy="allreduce", bucket_bytes=16 << 20, context=ctx
    )
    x = torch.randn(BATCH, WIDTH, device="cuda")
    for step in range(2 + steps):
        if step == 2:
            torch.cuda.synchronize()
            gate.wait(GATE_TIMEOUT)  # the warm-up is over on both ranks
            gate.wait(GATE_TIMEOUT)  # the main thread started the profiler
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    gate.wait(GATE_TIMEOUT)  # both ranks are done: the main thread stops the profiler
    gate.wait(GATE_TIMEOUT)
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
    gate = threading.Barrier(3)  # the two ranks and this thread
    sums: list[float] = []
    failure: list[BaseException] = []

    def ranks() -> None:
        try:
            sums.extend(run_ranks(2, lambda ctx: train(ctx, STEPS, gate), timeout=600))
        except BaseException as exc:
            failure.append(exc)
            gate.abort()  # the main thread's wait fails instead of hanging

    thread = threading.Thread(target=ranks, name="ranks")
    thread.start()
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    try:
        gate.wait(GATE_TIMEOUT)
        profiler.start()
        start = time.perf_counter()
        gate.wait(GATE_TIMEOUT)
        gate.wait(GATE_TIMEOUT)
        seconds = time.perf_counter() - start
        profiler.stop()
        gate.wait(GATE_TIMEOUT)
    finally:
        thread.join(600)
    if failure:
        raise failure[0]
    path = out / "overlap-trace.json"
    profiler.export_chrome_trace(str(path))
    result = {
        **overlap(json.loads(path.read_text())),
        "seconds_per_step": seconds / STEPS,
        "ranks_agree": sums[0] == sums[1],
        "device": torch.cuda.get_device_name(0),
    }
    (out / "overlap.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("gpu-overlap"))
