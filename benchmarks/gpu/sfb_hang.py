"""Why SFB with a CUDA model never finished (issue 42, item 1): the evidence, on a GPU machine.

Two thread ranks share one GPU and take one SFB step on an MLP, as ``tests/cuda/test_cuda_collectives.py`` does.

1. ``threads``: records which thread runs each rank's gradient hooks. For CUDA tensors autograd runs backward on
   its own thread per device, one per process, so both ranks' hooks run on the same thread (printed: the two
   ranks' hook thread ids and the callers' own).
2. ``hang``: the same step with the CUDA engine's collective choice left to the first collective on a CUDA tensor,
   as before the fix (``DistributedOptimizer`` now makes it at construction): SFB's first allgather of factors,
   inside rank 0's hook, then waits there for rank 1, whose backward cannot run while that thread is held. After
   ``--seconds`` the stacks of every thread are printed (Python's faulthandler) and the process leaves.

    python benchmarks/gpu/sfb_hang.py [threads|hang] [--seconds 15]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
from typing import Any

import torch

import paratrain.torch as ptt
from paratrain import Context
from paratrain.testing import run_ranks
from paratrain.torch import builders as builders_module


def step(ctx: Context, seen: dict[str, Any]) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).cuda()

    def note(_: torch.Tensor) -> None:  # (a hook must return None)
        seen.setdefault(f"rank {ctx.rank} hook thread", threading.get_ident())

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(note)  # type: ignore[no-untyped-call]
    seen[f"rank {ctx.rank} caller thread"] = threading.get_ident()
    opt = ptt.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), model=net, strategy="sfb", bucket_bytes=256, context=ctx
    )
    net(torch.ones(8, 10, device="cuda") * (ctx.rank + 1)).square().mean().backward()
    opt.step()
    opt.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["threads", "hang"], nargs="?", default="threads")
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/sfb_hang.py needs a CUDA device")
    seen: dict[str, Any] = {}
    if args.what == "hang":
        # before the fix: no choice at construction; the first collective on a CUDA tensor makes it
        builders_module.device_engines = lambda context, params: {}  # the builders look it up at each call
        faulthandler.dump_traceback_later(args.seconds, exit=False)
        timer = threading.Timer(args.seconds + 1, lambda: (print("HUNG: stacks above", flush=True), os._exit(3)))
        timer.daemon = True
        timer.start()
    run_ranks(2, lambda ctx: step(ctx, seen), timeout=args.seconds + 30)
    print({k: v for k, v in sorted(seen.items())}, flush=True)
    hooks = {v for k, v in seen.items() if "hook" in k}
    print(f"{args.what}: finished; the ranks' hooks ran on {len(hooks)} thread(s)", flush=True)


if __name__ == "__main__":
    main()
