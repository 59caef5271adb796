"""``paratrain train``: start a whole local training job, show its progress, and leave a run directory.

The job itself is :mod:`paratrain.train.job` (shared with ``compare`` and the benchmarks). The command starts
the cluster itself (``paratrain launch`` machinery: N workers, plus parameter servers for
the PS strategies), follows rank 0's metrics file to draw a progress bar, and when the job ends merges the
ranks' records into ``metrics.jsonl`` and ``timeline.json``, draws ``loss.png`` and ``accuracy.png``, and
writes ``summary.json`` (also to ``--json FILE``).
"""

from __future__ import annotations

import argparse

from paratrain.cli.errors import reports_config_errors
from paratrain.train.job import TrainJob, print_summary, require_train_extra, run_training

__all__ = ["add_common", "add_parser"]

STRATEGIES_HELP = (
    "allreduce, bsp, ssp:S (S = staleness bound), asp, gossip:ring|torus|exponential|complete|FILE (a graph, or a "
    "JSON mixing matrix), pipeline:gpipe|1f1b|pipedream|pipedream-vsync (--stages, --microbatches, --replicas)"
)


def add_common(p: argparse.ArgumentParser, *, strategy: bool = True) -> None:
    """Options shared by ``train`` and ``compare`` (which takes ``--strategies`` instead of ``--strategy``)."""
    from paratrain.train import stragglers
    from paratrain.train.pipeline_worker import add_pipeline_args
    from paratrain.train.worker import add_training_args

    add_training_args(p, strategy=strategy)
    p.add_argument(
        "--workers", type=int, default=None, help="worker processes (default 2; for pipelines stages x replicas)"
    )
    p.add_argument("--servers", type=int, default=None, help="parameter servers for bsp/ssp/asp (default 1)")
    p.add_argument("--straggler", default=None, help=stragglers.HELP)
    p.add_argument(
        "--faults", default=None, help="emulated network and faults, e.g. latency=2ms,bandwidth=100Mbit,drop=0.01"
    )
    p.add_argument("--latency", default=None, help="emulated one-way latency of every message, e.g. 2ms")
    p.add_argument("--bandwidth", default=None, help="emulated link of every process (in and out), e.g. 100Mbit")
    add_pipeline_args(p)
    from paratrain.launch.kills import HELP as KILL_HELP

    p.add_argument("--kill", default=None, metavar="SCHEDULE", help=KILL_HELP.replace("--kill-seed", "--seed"))


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``train`` on the ``paratrain`` parser."""
    p = sub.add_parser(
        "train",
        help="train a model on real data with a chosen synchronisation strategy",
        description=(
            "Train MODEL on DATASET with N local workers and the chosen strategy. With no flags: digits "
            "(bundled with scikit-learn), mlp, 2 workers, allreduce. Strategies: " + STRATEGIES_HELP + "."
        ),
    )
    add_common(p)
    p.add_argument("--run-dir", default=None, help="where to write the run (default runs/<time>-<strategy>)")
    p.add_argument("--json", default=None, help="also write the summary to this JSON file")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="allreduce: restart a crashed worker (up to R times in all); it recovers the model from the others' "
        "memory and replays, the others go on, and the result equals the fault-free run's to the bit. bsp/ssp/asp "
        "with --servers S --replicas 2: restart a dead parameter server, which catches up from its chunks' other "
        "replicas (default 0)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        metavar="K",
        help="with --max-restarts, --min-workers or --checkpoint-dir: steps between checkpoints (in memory, and "
        "on disk with --checkpoint-dir), where joiners are admitted too (default 10)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="allreduce: also write every checkpoint to DIR/checkpoint.npz; the same command run again after "
        "the whole job died resumes from it (the final model is the uninterrupted run's)",
    )
    p.add_argument(
        "--no-spare",
        action="store_true",
        help="with --max-restarts: start a restarted worker cold instead of from a warm spare process",
    )
    p.add_argument(
        "--min-workers",
        type=int,
        default=0,
        metavar="M",
        help="allreduce, elastic: a worker that dies with no warm spare ready is dropped and the others go on "
        "while M remain, each taking more of every step's examples (the global batch stays the launched one); "
        "with --max-restarts its cold replacement joins at the next checkpoint (default 0: not elastic)",
    )
    p.set_defaults(func=_main)


@reports_config_errors("train")
def _main(args: argparse.Namespace) -> int:
    if not require_train_extra("train"):
        return 2
    job = TrainJob(**vars(args))
    summary = run_training(job)
    print_summary(summary)
    return 0
