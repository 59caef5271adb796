"""``paratrain bench consistency``: BSP vs SSP vs ASP vs allreduce under stragglers, time to accuracy."""

from __future__ import annotations

import argparse
from pathlib import Path

from paratrain.cli.bench_common import options_from
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


_CONSISTENCY_EPILOG = """\
For every straggler scenario and strategy, one 'paratrain train' job (same model, data, seed, learning rate);
rounds interleaved: round 1 runs every cell once, then round 2, ... Scenarios are --straggler specs (see
'paratrain train --help'), or 'none'. Writes OUT/consistency.json (every run, medians), OUT/consistency.md (the
tables) and OUT/consistency.png (accuracy against training time, time to target), and prints the tables.

columns:
  time to T   rank 0's training time (its evaluations excluded) until its test accuracy, probed every
              --eval-every steps on a fixed 2,000-example test subset, first reached T: median (min-max)
              over rounds; [k/R] when only k of R rounds reached it
  vs bsp      bsp's time to T / this time: > 1 is faster than BSP
  final acc   rank 0's model on the whole test set after the last epoch: median (min-max)
  samples/s   all workers' samples / training time: median (min-max)

Exit code 0; 2 for bad arguments. A run takes minutes: about 30 s per job on 2 cores.

example:
  paratrain bench consistency --repeat 3 --out benchmarks/consistency/results
"""


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench consistency``."""
    from paratrain.bench.consistency import DEFAULT_SCENARIOS, DEFAULT_STRATEGIES

    p = bench_sub.add_parser(
        "consistency",
        help="BSP vs SSP(s) vs ASP vs allreduce under persistent and transient stragglers: time to accuracy",
        description=(
            "Train the same job with every strategy under every straggler scenario, repeated and interleaved, "
            "and report time to a target accuracy, final accuracy and samples/s (Ho et al. 2013's experiment)."
        ),
        epilog=_CONSISTENCY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES), help="comma-separated (default %(default)s)")
    p.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help="comma-separated --straggler specs or none (default %(default)s)",
    )
    p.add_argument("--model", default="lenet", help="mlp or lenet (default lenet)")
    p.add_argument("--dataset", default="fashion-mnist", help="digits or fashion-mnist (default fashion-mnist)")
    p.add_argument("--data-dir", default=None, help="directory of the Fashion-MNIST IDX files")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per job (default 1)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per worker per step (default 64)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of data order, init and stragglers (default 0)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    p.add_argument("--target", type=float, default=0.75, help="target test accuracy (default 0.75)")
    p.add_argument("--eval-every", type=int, default=20, help="steps between accuracy probes (default 20)")
    p.add_argument("--out", default=None, help="output directory (default runs/consistency-<time>)")
    p.set_defaults(func=_consistency_bench)


@reports_config_errors("bench consistency")
def _consistency_bench(args: argparse.Namespace) -> int:
    from paratrain.bench.consistency import ConsistencyBenchOptions, render_tables, run_consistency_bench

    def names(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(",") if part.strip())

    args.out = args.out or None  # an empty --out, as none, keeps the default folder
    options = options_from(
        ConsistencyBenchOptions, args, strategies=names(args.strategies), scenarios=names(args.scenarios)
    )
    for scenario in options.scenarios:  # every cell's job is checked before the first one runs
        for strategy in options.strategies:
            options.job(strategy, scenario, Path(options.out))
    report = run_consistency_bench(options)
    print(render_tables(report))
    print(f"figure: {Path(options.out) / 'consistency.png'}")
    return 0
