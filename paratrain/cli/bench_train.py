"""``paratrain bench train``: training samples/s, paratrain allreduce vs torch DDP vs one process."""

from __future__ import annotations

import argparse
import sys

from paratrain.cli.bench_common import options_from, print_report
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench train``."""
    p = bench_sub.add_parser(
        "train",
        help="training samples/s: paratrain allreduce vs torch DDP vs one process",
        description=(
            "Samples per second of data-parallel training with paratrain's DistributedOptimizer (allreduce), "
            "torch DistributedDataParallel (Gloo), and one process without communication, in one command."
        ),
    )
    p.add_argument("--model", default="mlp", help="mlp (784-512-512-10) or lenet (default mlp)")
    p.add_argument("--workers", type=int, default=2, help="worker processes for paratrain and DDP (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per worker per step (default 64)")
    p.add_argument("--steps", type=int, default=200, help="timed steps (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is reported (default 3)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds one engine run may take (default 180)")
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the model trains (default cpu); cuda adds DDP over NCCL where every worker has its own GPU",
    )
    p.add_argument("--json", default=None, help="write the report as JSON to this file")
    p.set_defaults(func=_train)


@reports_config_errors("bench train")
def _train(args: argparse.Namespace) -> int:
    from paratrain.bench.train import TrainBenchOptions, render, run_train_bench

    try:
        report = run_train_bench(options_from(TrainBenchOptions, args))
    except RuntimeError as exc:
        print(f"paratrain bench train: error: {exc}", file=sys.stderr)
        return 1
    return print_report("train", render(report), report, args.json, 0)
