"""``paratrain train``: start a whole local training job, show its progress, and leave a run directory.

Its flags are :class:`~paratrain.train.job.TrainJob`'s fields (:func:`~paratrain.train.job.add_job_options`); the
run is :func:`paratrain.train.run.run_training` (shared with ``compare``, ``plan --run`` and the benchmarks): it
starts the cluster itself (N workers, plus parameter servers for the PS strategies), follows rank 0's metrics file
to draw a progress bar, and when the job ends merges the ranks' records into ``metrics.jsonl`` and
``timeline.json``, draws ``loss.png`` and ``accuracy.png``, and writes ``summary.json`` (also to ``--json FILE``).
"""

from __future__ import annotations

import argparse

from paratrain.cli.errors import reports_config_errors
from paratrain.train.extra import require_train_extra
from paratrain.train.job import TrainJob, add_job_options
from paratrain.train.run import run_training
from paratrain.train.summary import print_summary

__all__ = ["add_parser"]

STRATEGIES_HELP = (
    "allreduce, bsp, ssp:S (S = staleness bound), asp, gossip:ring|torus|exponential|complete|FILE (a graph, or a "
    "JSON mixing matrix), pipeline:gpipe|1f1b|pipedream|pipedream-vsync (--stages, --microbatches, --replicas), "
    "poseidon[:allreduce], sfb, tp:N (linear layers split N-ways in Megatron's pairs; --workers a multiple of N) "
    "and soap:FILE (each layer split as the JSON file says)"
)


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
    add_job_options(p, "train")
    p.set_defaults(func=_main)


@reports_config_errors("train")
def _main(args: argparse.Namespace) -> int:
    if not require_train_extra("train"):
        return 2
    summary = run_training(TrainJob.from_args(args))
    print_summary(summary)
    return 0
