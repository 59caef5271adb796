"""``paratrain bench soap``: paratrain's tensor parallelism vs torch's parallelize_module vs one process."""

from __future__ import annotations

import argparse

from paratrain.cli.bench_common import options_from, print_report
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]

_HELP = "tensor-parallel training: paratrain's split layers vs torch's parallelize_module vs one process"
_EPILOG = """\
One single-threaded process trains the whole model; then, for every N of --tensor, paratrain
(paratrain.torch.soap.parallelize under 'paratrain launch') and torch (parallelize_module with ColwiseParallel
and RowwiseParallel on a CPU device mesh over Gloo), N processes each, split alike (Megatron-LM's pairs: a
Linear by its output features, the next by its input features, the output all-reduced). One engine at a time;
with --repeat R, R interleaved rounds. Every process is single-threaded and trains on the same synthetic 28x28
mini-batches from the same initial weights; an engine whose first 2 losses differ from one process's (relative
1e-4) is reported as failed and not timed.

columns:
  ms/step     forward + backward + SGD step with momentum: the slowest rank's median; median (min-max) of runs
  torch/pt    torch's ms/step / paratrain's at the same N (> 1: paratrain faster)
  params      the bytes of the parameters the largest rank holds (read from its tensors) and / one process's

Exit code 0; 1 if an engine failed or disagreed with one process; 2 for bad arguments.

example:
  paratrain bench soap --model widemlp --tensor 2,4 --repeat 3 --json soap.json
"""


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench soap``."""
    p = bench_sub.add_parser("soap", help=_HELP, description=_HELP, epilog=_EPILOG)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add = p.add_argument
    add("--model", default="widemlp", help="a paratrain train image model (default widemlp)")
    add("--tensor", type=_ints, default=(2, 4), help="N, the split degrees = processes, comma-separated (2,4)")
    add("--batch-size", type=int, default=64, help="samples per mini-batch (default 64)")
    add("--steps", type=int, default=20, help="timed steps (default 20)")
    add("--warmup", type=int, default=3, help="untimed steps first, at least 2 (default 3)")
    add("--no-torch", action="store_true", help="do not run torch's parallelize_module")
    add("--repeat", type=int, default=3, help="interleaved rounds; the median is reported (default 3)")
    add("--timeout", type=float, default=300.0, help="seconds one engine run may take (default 300)")
    add("--json", metavar="FILE", default=None, help="write every number to FILE as JSON")
    p.set_defaults(func=_soap)


@reports_config_errors("bench soap")
def _soap(args: argparse.Namespace) -> int:
    from paratrain.bench.soap import SoapBenchOptions, render, run_bench

    report, code = run_bench(options_from(SoapBenchOptions, args, torch=not args.no_torch))
    return print_report("soap", render(report), report, args.json, code)
