"""``paratrain bench pipeline``: paratrain Pipe vs torch.distributed.pipelining vs one process."""

from __future__ import annotations

import argparse

from paratrain.cli.bench_common import options_from, print_report
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


_PIPELINE_EPILOG = """\
For every model: one single-threaded process training the whole model with the same micro-batch loop (each
micro-batch's summed cross-entropy back-propagated in turn, then one SGD step); then, for every K of --stages and
every schedule, paratrain's Pipe (K processes under 'paratrain launch', trace= spans on) and
torch.distributed.pipelining (PipelineStage + ScheduleGPipe/Schedule1F1B, Gloo, scale_grads=False), K
processes. One engine at a time; with --repeat R, R interleaved rounds. Every process is single-threaded and
trains on the same synthetic 28x28 mini-batches from the same initial weights. The split into stages is computed
once (profile_layers on one micro-batch + the partitioner, or --balance) and given to both pipelines.
Before timing, this process computes one process's losses of the first 2 steps; an engine whose losses differ
(relative 1e-5) is reported as failed and not timed.

columns:
  samples/s   batch x timed steps / the slowest process's time: median (min-max) over runs
  ms/step     the slowest process's time / timed steps
  vs 1 proc   samples/s / the one-process engine's;  pt/torch: paratrain / torch pipelining, same schedule
  idle        per stage: 1 - (compute spans) / (step wall time), median over timed steps; theory (K-1)/(M+K-1)
  compute ms  per stage: forward + backward (+ optimizer) spans per step; imbalance = slowest / mean,
              'predicted' = the partitioner's slowest / mean stage time from the profile
  RSS +       per stage: peak RSS (VmHWM, reset after warm-up) minus the RSS at that moment
  held        Pipe.peak_held_bytes (inputs + tensors saved for backward of micro-batches in flight), without and
              with checkpoint=True (one extra untimed step); one process: one micro-batch of the whole model
  micro-batches  held / (GPipe's held / M): how many micro-batches' activations the stage held at once

--json FILE writes every number: options, machine, cases (balance, predicted stage times), reference losses,
engines (status, detail) and results (per engine: samples_per_s and its runs, step_ms, per stage idle,
compute_ms, step_ms, rss_growth_bytes, held_bytes, held_bytes_checkpoint).

Exit code 0; 1 if an engine failed or disagreed with one process; 2 for bad arguments. Timings are only
meaningful on an otherwise idle machine.

example:
  paratrain bench pipeline --model mlp --stages 2 --microbatches 8 --repeat 3 --json pipeline.json
"""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench pipeline``."""
    p = bench_sub.add_parser(
        "pipeline",
        help="pipeline-parallel training: paratrain Pipe vs torch.distributed.pipelining vs one process",
        description=(
            "Samples/s, bubble, stage balance and memory of pipeline-parallel training with paratrain's Pipe and "
            "torch.distributed.pipelining, next to one process, on the same model, split and micro-batches."
        ),
        epilog=_PIPELINE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=_names, default=("mlp",), help="paratrain train models, comma-separated (mlp)")
    p.add_argument("--stages", type=_ints, default=(2,), help="K, pipeline stages, comma-separated (default 2)")
    p.add_argument("--microbatches", type=int, default=8, help="M, micro-batches per mini-batch (default 8)")
    p.add_argument("--batch-size", type=int, default=256, help="samples per mini-batch (default 256)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first, at least 2 (default 5)")
    p.add_argument("--schedules", type=_names, default=("gpipe", "1f1b"), help="gpipe,1f1b (default both)")
    p.add_argument("--balance", type=_ints, default=None, help="layers per stage (default: profile + partition)")
    p.add_argument("--no-torch", action="store_true", help="do not run torch.distributed.pipelining")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is reported (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one engine run may take (default 300)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every number to FILE as JSON")
    p.set_defaults(func=_pipeline)


@reports_config_errors("bench pipeline")
def _pipeline(args: argparse.Namespace) -> int:
    from paratrain.bench.pipeline import PipelineBenchOptions, render, run_bench

    report, code = run_bench(options_from(PipelineBenchOptions, args, models=args.model, torch=not args.no_torch))
    return print_report("pipeline", render(report), report, args.json, code)
