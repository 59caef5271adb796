"""``paratrain bench``: measure paratrain's collectives against Gloo and OpenMPI on this machine.

Each subcommand is a thin argparse front over its benchmark module (:mod:`paratrain.bench`); they share the report
and option helpers here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from paratrain.cli import bench_sched, bench_sim
from paratrain.cli.errors import reports_config_errors
from paratrain.errors import ConfigError

__all__ = ["add_parser"]

_ALLREDUCE_EPILOG = """\
Engines run one after another, never at the same time: paratrain (pt.allreduce_ with --algorithm, and the
shared-memory path directly as 'paratrain-shm') under 'paratrain launch', then torch.distributed with Gloo,
then OpenMPI through mpi4py under mpirun. A missing anchor (no torch, no mpi4py or mpirun) is skipped with a
note. All engines allreduce float32 buffers with sum, check the result once, warm up, then time ITERS calls back
to back.

columns:
  time      mean time per call of the back-to-back calls, slowest rank (as nccl-tests averages);
            with --repeat R, the median of R runs of each engine, interleaved with the other engines
  p50       median over calls of the slowest rank's time for that call
  algbw     size / time;  busbw = algbw * 2(N-1)/N (nccl-tests), comparable across N
  X/this    anchor X's time / this row's time: > 1 means paratrain is faster

--json FILE writes: benchmark, np, dtype, op, algorithm, sizes, compare, repeat, date, machine (cpus,
processor, platform, python, load_before, busy_before, load_after), timing (the definitions), engines (name -> status
ok|skipped|error, detail) and results (rows: engine, bytes, size, iters, time_us, p50_us, runs_us, algbw_gbps,
busbw_gbps, and for paratrain rows ratios {anchor: anchor time / this time}).

Sizes: 1024, 4KiB or 4K (x1024), 16MB (x1000); multiples of 4 bytes. Exit code: 0, or 1 if an engine failed,
2 for bad arguments. Timings are only meaningful on an otherwise idle machine.

example:
  paratrain bench allreduce --np 2 --sizes 4KiB,1MiB,16MiB,64MiB --compare gloo,mpi --json out.json
"""


def _sizes(text: str) -> list[int]:
    from paratrain.bench.harness import parse_sizes

    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _compare(text: str) -> list[str]:
    from paratrain.bench.allreduce import ANCHORS

    names = [] if text.strip().lower() in ("", "none") else [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in ANCHORS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown anchor {', '.join(bad)}; choose from {', '.join(ANCHORS)} or none")
    return list(dict.fromkeys(names))


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench`` (and its subcommands) on the ``paratrain`` parser."""
    p = sub.add_parser(
        "bench",
        help="measure paratrain against Gloo, OpenMPI, DDP and the hardware's ceilings on this machine",
        description="Benchmarks of paratrain against reference implementations, measured in the same run.",
    )
    p.set_defaults(func=lambda args: _usage(p))
    bench_sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    a = bench_sub.add_parser(
        "allreduce",
        help="allreduce time and bandwidth per size: paratrain vs Gloo vs OpenMPI",
        description="Time allreduce of N local ranks for each size with paratrain, Gloo and OpenMPI.",
        epilog=_ALLREDUCE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a.add_argument("--np", dest="nproc", type=int, default=2, help="ranks (processes) per engine (default 2)")
    a.add_argument("--sizes", type=_sizes, default=None, help="comma-separated sizes (default 4KiB,1MiB,16MiB,64MiB)")
    a.add_argument(
        "--compare",
        type=_compare,
        default=None,
        help="anchors: gloo,mpi,horovod (default; each skipped where not installed), a subset, or none",
    )
    a.add_argument("--iters", type=int, default=None, help="timed calls per size (default: 500 small .. 10 large)")
    a.add_argument("--warmup", type=int, default=5, help="untimed calls per size before timing (default 5)")
    a.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every engine R times, interleaved, and report the median run (default 1; use 3+ on noisy machines)",
    )
    a.add_argument(
        "--algorithm",
        default="auto",
        choices=("auto", "ring", "tree", "shm", "gloo"),
        help="algorithm= of pt.allreduce_ (default auto; shm is registered if the API lacks it; gloo: torch tensors "
        "through paratrain's torch.distributed engine)",
    )
    a.add_argument("--no-shm", action="store_true", help="do not time the shared-memory path directly")
    a.add_argument("--timeout", type=float, default=600.0, help="seconds each engine may run (default 600)")
    a.add_argument("--json", metavar="FILE", default=None, help="write every number to FILE as JSON")
    a.set_defaults(func=_allreduce)
    _add_ps_parser(bench_sub)
    _add_train_parser(bench_sub)
    _add_consistency_parser(bench_sub)
    _add_pipeline_parser(bench_sub)
    _add_recovery_parser(bench_sub)
    _add_auth_parser(bench_sub)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _report(command: str, table: str, report: dict[str, Any], json_path: str | None, code: int) -> int:
    """Prints a benchmark's table, writes its JSON if asked, and returns the exit code (1 if the JSON failed)."""
    print()
    print(table, flush=True)
    if json_path:
        try:
            with open(json_path, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            print(f"paratrain bench {command}: error: cannot write {json_path}: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {json_path}")
    return code


@reports_config_errors("bench allreduce")
def _allreduce(args: argparse.Namespace) -> int:
    from paratrain.bench.allreduce import ANCHORS, DEFAULT_SIZES, BenchOptions, render_table, run_bench
    from paratrain.bench.harness import parse_sizes

    options = BenchOptions(
        nproc=args.nproc,
        sizes=tuple(args.sizes or parse_sizes(DEFAULT_SIZES)),
        compare=tuple(ANCHORS if args.compare is None else args.compare),
        iters=args.iters,
        warmup=args.warmup,
        algorithm=args.algorithm,
        timeout=args.timeout,
        shm=not args.no_shm,
        repeat=args.repeat,
    )
    report, code = run_bench(options)
    return _report("allreduce", render_table(report), report, args.json, code)


_PS_EPILOG = """\
Two jobs run one after the other, never at the same time (with --repeat R, R times each, interleaved):
  ps       'paratrain launch -n W --servers S': every worker makes a KVStore with --consistency, inits one
           float32 key per size (cut into 1 MiB chunks over the servers), checks one round, warms up, passes a
           barrier, then times ITERS iterations of push(key, grad) + clock() + pull(key, out=buf);
  ceiling  'paratrain launch -n W+S' with no parameter server: W ranks send the same chunks to S echo ranks and
           receive them back with plain transport send/recv (same transport: on one host ipc headers with the
           data in shared-memory lanes; with --hosts 2 TCP between the emulated hosts; same process count);
and, in this process before and after the jobs (the faster kept), np.copyto of each size (memcpy: the bound
of a shared-memory parameter server).

columns (every worker pushes `size` bytes and pulls `size` bytes per iteration):
  p50, p90     median / 90th percentile over iterations of the slowest worker's time for the iteration
  mean         the slowest worker's loop time / ITERS (with --repeat R: the median of the R runs)
  worker GB/s  bytes pushed + pulled per second by one worker: 2*size / mean (1 GB = 10^9 B)
  total GB/s   all workers together: W * worker GB/s
  % ceiling    ps total GB/s / ceiling total GB/s: what the parameter server keeps of its transport
  % memcpy     ps worker GB/s / memcpy GB/s

--json FILE writes: benchmark, workers, servers, consistency, dtype, sizes, iters, warmup, repeat,
chunk_bytes, transport, date, machine (cpus, processor, platform, python, load_before, busy_before,
others_busy_during, load_after), definitions, engines (ps|ceiling -> status ok|error, detail),
memcpy (rows: bytes, size, gbps) and results (rows: engine, bytes, size, chunks, servers_used, iters,
mean_ms, p50_ms, p90_ms, runs_ms, worker_gbps, aggregate_gbps, phases_ms, and for ps rows pct_of_ceiling,
pct_of_memcpy).

Sizes: 1024, 64KiB or 64K (x1024), 16MB (x1000), comma-separated for several; multiples of 4 bytes. Exit code:
0, or 1 if a job failed, 2 for bad arguments. Timings are only meaningful on an otherwise idle machine.

example:
  paratrain bench ps --workers 2 --servers 2 --size 16MiB --repeat 3 --json ps.json
"""


def _consistency(text: str) -> str:
    from paratrain.bench.ps import parse_consistency

    try:
        kind, bound = parse_consistency(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return kind if bound is None else f"{kind}:{bound}"


def _add_ps_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench ps``."""
    p = bench_sub.add_parser(
        "ps",
        help="parameter-server push/clock/pull latency and throughput vs the transport's ceiling",
        description=(
            "Time KVStore push+clock+pull of W workers against S parameter servers, and the same bytes moved by "
            "the same transport without a parameter server (the ceiling), in one run."
        ),
        epilog=_PS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes W (default 2)")
    p.add_argument("--servers", type=int, default=1, help="parameter-server processes S (default 1)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="servers holding each chunk (primary-backup; default 1): run 1 and 2 to measure replication's cost",
    )
    p.add_argument("--size", type=_sizes, default=None, help="key size(s), comma-separated (default 16MiB)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: 300 small .. 10 large)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per size before timing (default 3)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run both jobs R times, interleaved, and report the median run (default 1; use 3+ on noisy machines)",
    )
    p.add_argument(
        "--consistency",
        type=_consistency,
        default="bsp",
        help="bsp (default), asp, or ssp:S with staleness bound S (pulls wait for the slowest worker under bsp)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        choices=(1, 2),
        default=1,
        help="1 (default): every process on this host; 2: workers and servers on two emulated hosts (network "
        "namespaces joined by a veth pair, TCP between them; needs root)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each job may run (default 300)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every number to FILE as JSON")
    p.set_defaults(func=_ps)


@reports_config_errors("bench ps")
def _ps(args: argparse.Namespace) -> int:
    from paratrain.bench.ps import PSBenchOptions, render_table, run_bench

    options = PSBenchOptions(
        workers=args.workers,
        servers=args.servers,
        sizes=tuple(args.size or [16 << 20]),
        replicas=args.replicas,
        consistency=args.consistency,
        hosts=args.hosts,
        iters=args.iters,
        warmup=args.warmup,
        repeat=args.repeat,
        timeout=args.timeout,
    )
    try:
        report, code = run_bench(options)
    except RuntimeError as exc:  # --hosts 2: the emulated hosts could not be made (not root, no iproute2...)
        print(f"paratrain bench ps: error: {exc}", file=sys.stderr)
        return 2
    return _report("ps", render_table(report), report, args.json, code)


def _add_train_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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

    options = TrainBenchOptions(
        model=args.model,
        workers=args.workers,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        repeat=args.repeat,
        timeout=args.timeout,
        device=args.device,
    )
    try:
        report = run_train_bench(options)
    except RuntimeError as exc:
        print(f"paratrain bench train: error: {exc}", file=sys.stderr)
        return 1
    return _report("train", render(report), report, args.json, 0)


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


def _add_consistency_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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

    options = ConsistencyBenchOptions(
        strategies=names(args.strategies),
        scenarios=names(args.scenarios),
        model=args.model,
        dataset=args.dataset,
        data_dir=args.data_dir,
        workers=args.workers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        repeat=args.repeat,
        target=args.target,
        eval_every=args.eval_every,
        **({"out": args.out} if args.out else {}),
    )
    for scenario in options.scenarios:  # every cell's job is checked before the first one runs
        for strategy in options.strategies:
            options.job(strategy, scenario, Path(options.out))
    report = run_consistency_bench(options)
    print(render_tables(report))
    print(f"figure: {Path(options.out) / 'consistency.png'}")
    return 0


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


def _add_pipeline_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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

    options = PipelineBenchOptions(
        models=args.model,
        stages=args.stages,
        microbatches=args.microbatches,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        schedules=args.schedules,
        torch=not args.no_torch,
        balance=args.balance,
        repeat=args.repeat,
        timeout=args.timeout,
    )
    report, code = run_bench(options)
    return _report("pipeline", render(report), report, args.json, code)


def _add_recovery_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench recovery``."""
    p = bench_sub.add_parser(
        "recovery",
        help="kill workers on 16 schedules: bitwise-equal results and recovery time vs torchrun --max-restarts",
        description=(
            "Runs paratrain train --max-restarts on the digits MLP with 14 kill schedules (2 and 3 workers, "
            "before, at, during and after a checkpoint, two deaths at once and in a row), checks each final "
            "model is bitwise the fault-free run's and that no survivor rolled back, and times death -> detected "
            "-> re-formed -> transferred -> back at the failed step, beside torchrun --max-restarts 1 on the same "
            "job with a disk checkpoint; two more schedules restart cold (no warm spare), as torchrun must. Takes "
            "about 8 minutes."
        ),
    )
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (default 5)")
    p.add_argument("--torchrun-repeat", type=int, default=3, help="torchrun anchor runs, interleaved (default 3)")
    p.add_argument("--quick", action="store_true", help="the first 3 schedules and one torchrun run")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="instead: an elastic job (train --workers 3 --min-workers 2) shrinking at 4 kill steps and growing "
        "back with a cold replacement: its models against the fault-free run's, and the times (paratrain.bench."
        "elastic; about 4 minutes per --repeat)",
    )
    p.add_argument(
        "--server",
        action="store_true",
        help="instead: a replicated parameter server SIGKILLed, restarted and caught up, at 1, 16 and 64 MiB of "
        "parameters: failover, time back and the workers' pause, against the transport's ceiling for the "
        "snapshot (paratrain.bench.server_restart; about 2 minutes per --repeat)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="with --elastic (default 1) or --server (default 3): rounds, interleaved",
    )
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_recovery)


@reports_config_errors("bench recovery")
def _recovery(args: argparse.Namespace) -> int:
    from paratrain.bench.recovery import COLD_SCHEDULES, DEFAULT_SCHEDULES, render, run_bench

    if args.server:
        from paratrain.bench import server_restart

        sizes = server_restart.SIZES[:1] if args.quick else server_restart.SIZES
        found = server_restart.run_server_bench(sizes, repeat=1 if args.quick else args.repeat or 3)
        good = all(r["ok"] for r in found["runs"])
        return _report("recovery", server_restart.render(found), found, args.json, 0 if good else 1)
    if args.elastic:
        from paratrain.bench import elastic

        found = elastic.run_elastic_bench(
            elastic.KILL_STEPS[:1] if args.quick else elastic.KILL_STEPS, repeat=args.repeat or 1
        )
        good = found["fault_free_bitwise_equal"] and all(r["exit"] == 0 and r["ranks_equal"] for r in found["runs"])
        return _report("recovery", elastic.render(found), found, args.json, 0 if good else 1)

    schedules = DEFAULT_SCHEDULES[:3] if args.quick else DEFAULT_SCHEDULES + COLD_SCHEDULES
    report = run_bench(
        schedules, every=args.checkpoint_every, torchrun_repeat=1 if args.quick else args.torchrun_repeat
    )
    code = 0 if all(r["bitwise_equal"] and r["no_rollback"] for r in report["schedules"]) else 1
    return _report("recovery", render(report), report, args.json, code)


def _add_auth_parser(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``bench auth``."""
    p = bench_sub.add_parser(
        "auth",
        help="what authentication costs: latency (4 KiB) and bandwidth (16 MiB) with and without a secret",
        description=(
            "Two processes measure paratrain's round trip and one-way bandwidth over TCP (different host ids) and "
            "ipc (the same host id), without a secret and with one (CURVE on TCP, a checked password on ipc), "
            "every configuration once per round, interleaved; reports the median and min-max over rounds."
        ),
    )
    p.add_argument("--repeat", type=int, default=5, help="rounds of every configuration, interleaved (default 5)")
    p.add_argument("--round-trips", type=int, default=2000, help="timed 4 KiB ping-pongs per run (default 2000)")
    p.add_argument("--messages", type=int, default=8, help="16 MiB messages per bandwidth run (default 8)")
    p.add_argument("--latency-size", type=_sizes, default=[4 << 10], help="ping-pong payload (default 4KiB)")
    p.add_argument("--bandwidth-size", type=_sizes, default=[16 << 20], help="bulk message size (default 16MiB)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_auth)
    _add_sfb_bytes(bench_sub)
    _add_ddp_anchor(bench_sub)
    bench_sim.add_parsers(bench_sub)  # simulator, scaling
    bench_sched.add_parsers(bench_sub)  # sched


def _add_sfb_bytes(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "sfb-bytes",
        help="bytes per step of allreduce, the parameter server and SFB per layer, measured vs the cost model",
        description=(
            "Trains single fully-connected layers (the FC-heavy MLP's and LeNet-5's) and the whole FC-heavy MLP "
            "under poseidon for a few steps, with P workers over ZeroMQ on loopback, and prints the bytes one "
            "worker sends and receives per step next to paratrain.sfb.cost's prediction."
        ),
    )
    p.add_argument("--workers", type=int, default=4, help="P (default 4)")
    p.add_argument("--batch", type=int, default=64, help="K, rows per worker and step (default 64)")
    p.add_argument("--servers", type=int, default=1, help="parameter servers for the ps rows (default 1)")
    p.add_argument("--steps", type=int, default=3, help="steps measured after the first (default 3)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_sfb_bytes)


@reports_config_errors("bench sfb-bytes")
def _sfb_bytes(args: argparse.Namespace) -> int:
    from paratrain.bench.sfb_bytes import render_bytes, run_bytes_bench

    if min(args.workers, args.batch, args.servers, args.steps) < 1:
        raise ConfigError("--workers, --batch, --servers and --steps must be >= 1")
    report = run_bytes_bench(workers=args.workers, batch=args.batch, servers=args.servers, steps=args.steps)
    return _report("sfb-bytes", render_bytes(report), report, args.json, 0)


def _add_ddp_anchor(bench_sub: Any) -> None:
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
    return _report("ddp-anchor", render_ddp_anchor(report, args.target_accuracy), report, args.json, 0)


@reports_config_errors("bench auth")
def _auth(args: argparse.Namespace) -> int:
    from paratrain.bench.auth import AuthBenchOptions, render, run_auth_bench

    options = AuthBenchOptions(
        latency_bytes=args.latency_size[0],
        bandwidth_bytes=args.bandwidth_size[0],
        round_trips=args.round_trips,
        messages=args.messages,
        repeat=args.repeat,
    )
    report = run_auth_bench(options)
    return _report("auth", render(report), report, args.json, 0)
