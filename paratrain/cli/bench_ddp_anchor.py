"""``paratrain bench ddp-anchor``: torch DDP with its compression hooks, trained like ``paratrain train``."""

from __future__ import annotations

import argparse
from typing import Any

from paratrain.cli.bench_common import print_report
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


def add_parsers(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "ddp-anchor",
        help="torch DDP with fp16_compress_hook / powerSGD_hook, trained like paratrain train (the anchor)",
        description=(
            "Trains the model with torch DDP over Gloo, with each of --hooks, on the data, shards, optimizer and "
            "seed paratrain train uses; with --rate inside a network namespace whose loopback is throttled by tc "
            "tbf (needs root). Prints samples/s, final test accuracy and time to --target-accuracy per hook."
        ),
    )
    p.add_argument("--hooks", default="none,fp16,powersgd:4", help="none, fp16, powersgd:R (default all three, R=4)")
    p.add_argument("--workers", type=int, default=4, help="DDP ranks (default 4)")
    p.add_argument("--rate", default=None, help="throttle loopback to this tc rate, e.g. 100mbit (default: none)")
    p.add_argument("--model", default="widemlp", help="a paratrain train model (default widemlp)")
    p.add_argument("--dataset", default="fashion-mnist", help="a paratrain train dataset (default fashion-mnist)")
    p.add_argument("--data-dir", default=None, help="directory of the dataset's files")
    p.add_argument("--epochs", type=int, default=1, help="epochs (default 1)")
    p.add_argument("--steps-per-epoch", type=int, default=0, help="cut each epoch to N steps (default 0: whole)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per worker and step (default 64)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every hook, interleaved (default 1)")
    p.add_argument("--target-accuracy", type=float, default=0.8, help="for the time-to-accuracy column (0.8)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_ddp_anchor)


@reports_config_errors("bench ddp-anchor")
def _ddp_anchor(args: argparse.Namespace) -> int:
    from paratrain.bench.ddp_anchor import render_ddp_anchor, run_ddp_anchor
    from paratrain.errors import ConfigError

    train_args = ["--model", args.model, "--dataset", args.dataset, "--epochs", str(args.epochs)]
    train_args += ["--steps-per-epoch", str(args.steps_per_epoch), "--batch-size", str(args.batch_size)]
    train_args += ["--lr", str(args.lr), "--seed", str(args.seed)]
    if args.data_dir:
        train_args += ["--data-dir", args.data_dir]
    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    if not hooks or args.workers < 1 or args.repeat < 1:
        raise ConfigError("--hooks must name a hook, and --workers and --repeat must be >= 1")
    report = run_ddp_anchor(
        hooks=hooks, workers=args.workers, rate=args.rate, train_args=train_args, repeat=args.repeat
    )
    return print_report("ddp-anchor", render_ddp_anchor(report, args.target_accuracy), report, args.json, 0)
