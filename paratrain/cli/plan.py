"""``paratrain plan``: predict every configuration of a training job on a profiled machine, rank them, and run the
best ones to confirm."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.cli.errors import reports_config_errors
from paratrain.errors import ConfigError
from paratrain.strategy import parse_strategy

if TYPE_CHECKING:
    from paratrain.sim.machine import MachineProfile, ModelProfile
    from paratrain.sim.search import Candidate, Scored

#: What ``--strategies`` searches by default: :data:`paratrain.sim.search.SEARCHED` (a test keeps them equal;
#: written out so that ``paratrain --help`` does not import the simulator).
DEFAULT_STRATEGIES = (
    "allreduce,bsp,ssp:2,asp,sfb,poseidon:allreduce,gossip:ring,gossip:exponential,pipeline:gpipe,pipeline:1f1b,"
    "tp:2,tp:4"
)

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``plan`` on the ``paratrain`` parser."""
    p = sub.add_parser(
        "plan",
        help="predict the step time of every strategy for a model on this machine and rank them",
        description=(
            "Search strategies (allreduce with or without fp16 compression, the BSP, SSP or ASP parameter server with "
            "1-4 servers, SFB, the Poseidon hybrid, gossip on the ring or exponential graph, GPipe and 1F1B "
            "pipelines of one stage per worker, linear layers split 2- or 4-ways in Megatron's pairs), bucket sizes "
            "and overlap for a data-parallel job, predicting "
            "each with the simulator from a machine profile (paratrain profile), and print them ranked with the "
            "reason for the pick; the 'update' column marks those whose step is not synchronous SGD's (--exact "
            "leaves them out). --run trains the top candidates and the default allreduce for a few steps to confirm."
        ),
    )
    p.add_argument("--model", required=True, help="a model of paratrain train (profiled in --machine)")
    p.add_argument("--workers", type=int, required=True, help="worker processes of the job")
    p.add_argument("--batch-size", type=int, default=64, help="examples per worker and step (default 64)")
    p.add_argument("--hosts", type=int, default=1, help="hosts the workers are spread over (default 1)")
    p.add_argument("--bandwidth", default=None, help="emulated link of every process, as train's, e.g. 100Mbit")
    p.add_argument("--latency", default=None, help="emulated one-way latency, as train's, e.g. 2ms")
    p.add_argument(
        "--links",
        default=None,
        metavar="FILE",
        help="pairs of ranks with links of their own, as --faults links=FILE (JSON); allreduce may then use trees",
    )
    p.add_argument(
        "--machine",
        default="machine.json",
        help="the machine profile (default machine.json; make it with 'paratrain profile --model M --workers N')",
    )
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"the strategies to search (default {DEFAULT_STRATEGIES})",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="only configurations whose step is synchronous SGD's exactly (no compression, ssp, asp or gossip)",
    )
    p.add_argument(
        "--straggler",
        default=None,
        metavar="RANK:FACTOR",
        help="worker RANK computes FACTOR times slower (a persistent straggler, as train's --straggler RANK:FACTOR)",
    )
    p.add_argument("--top", type=int, default=10, help="rows of the ranking to print (default 10)")
    p.add_argument("--run", action="store_true", help="train the top --confirm candidates and the default to confirm")
    p.add_argument("--confirm", type=int, default=2, help="with --run: how many top candidates (default 2)")
    p.add_argument("--steps", type=int, default=10, help="with --run: steps per confirming run (default 10)")
    p.add_argument("--dataset", default="fashion-mnist", help="with --run: the dataset (default fashion-mnist)")
    p.add_argument("--trace", default=None, help="write the pick's simulated step as a Chrome trace to this file")
    p.add_argument("--json", default=None, help="also write the ranking (and confirmations) to this JSON file")
    p.add_argument(
        "--search",
        choices=("strategies", "soap"),
        default="strategies",
        help="what to search: whole-model strategies (default), or soap: which layers to split over how many "
        "workers (FlexFlow's per-operator configurations), against the best whole-model strategy",
    )
    p.add_argument("--budget", default="30s", help="--search soap: time budget, e.g. 30s (default 30s)")
    p.add_argument("--proposals", type=int, default=0, help="--search soap: also stop after N proposals (0: off)")
    p.add_argument(
        "--alpha", type=float, default=20.0, help="--search soap: the chain's reluctance to move to a slower point (20)"
    )
    p.add_argument("--seed", type=int, default=0, help="--search soap: the chain's random seed (default 0)")
    p.add_argument(
        "--soap-out",
        default=None,
        metavar="FILE",
        help="--search soap: where to write the pick (default runs/soap-MODEL-wWORKERS.json), for train's "
        "--strategy soap:FILE",
    )
    p.set_defaults(func=_plan)


@reports_config_errors("plan")
def _plan(args: argparse.Namespace) -> int:
    from paratrain.config import parse_duration
    from paratrain.sim.machine import MachineProfile
    from paratrain.sim.search import SEARCHED, Candidate, search
    from paratrain.transport.faults import parse_bandwidth, read_links

    if args.workers < 1 or args.batch_size < 1 or args.hosts < 1:
        raise ConfigError("--workers, --batch-size and --hosts must be >= 1")
    if args.search == "soap":
        from paratrain.cli.plan_soap import plan_soap

        bandwidth = parse_bandwidth(args.bandwidth) if args.bandwidth else None
        return plan_soap(args, bandwidth=bandwidth, latency=parse_duration(args.latency) if args.latency else 0.0)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in SEARCHED]
    if unknown:
        raise ConfigError(f"the planner searches {', '.join(SEARCHED)}; not {', '.join(unknown)}")
    profile = MachineProfile.load(args.machine)
    model = profile.model(args.model, args.batch_size, args.workers)
    bandwidth = parse_bandwidth(args.bandwidth) if args.bandwidth else None
    latency = parse_duration(args.latency) if args.latency else 0.0
    slowdown = _slowdown(args.straggler, args.workers)
    space = _space(args, model, strategies)
    # the job and network that search() ranks in and predict() traces the pick in
    setting: dict[str, Any] = {
        "workers": args.workers,
        "batch_size": args.batch_size,
        "bandwidth": bandwidth,
        "latency": latency,
        "hosts": args.hosts,
        "slowdown": slowdown,
        "links": read_links(args.links) if args.links else (),
    }
    ranked = search(profile, model, space=space, **setting)
    default = next(s for s in ranked if s.candidate == Candidate())
    _print_ranking(args, profile.name, ranked, default)
    result: dict[str, Any] = {
        "model": args.model,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "bandwidth": args.bandwidth,
        "latency": args.latency,
        "links": args.links,
        "machine": profile.name,
        "ranking": [
            {
                "configuration": s.candidate.label,
                "flags": s.train_flags(),
                "step_s": s.step_s,
                "update": s.candidate.update,
            }
            for s in ranked
        ],
    }
    if args.trace:
        _trace_pick(args.trace, profile, model, ranked[0].candidate, setting)
    if args.run:
        result["confirmed"] = _confirm(args, ranked, default)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _slowdown(spec: str | None, workers: int) -> list[float] | None:
    """``--straggler RANK:FACTOR`` as the simulator's per-rank slowdown.

    Raises:
        ConfigError: not RANK:FACTOR with 0 <= RANK < workers and FACTOR >= 1 (the planner models a persistent
            straggler; train's random and pareto models vary per step).
    """
    if spec is None:
        return None
    rank, _, factor = spec.partition(":")
    try:
        r, f = int(rank), float(factor)
    except ValueError:
        r, f = -1, 0.0
    if not 0 <= r < workers or f < 1.0:
        raise ConfigError(
            f"--straggler {spec!r}: the planner takes RANK:FACTOR (a worker 0..{workers - 1} that computes FACTOR "
            ">= 1 times slower, e.g. 1:3); train's random: and pareto: stragglers vary per step and are not modelled"
        )
    slowdown = [1.0] * workers
    slowdown[r] = f
    return slowdown


def _row(rank: int, s: Any, default: Any) -> None:
    p = s.prediction
    print(
        f"| {rank} | {s.candidate.label} | {p.step_s:.3f} | {default.step_s / p.step_s:.2f}x | {p.compute_s:.3f} "
        f"| {p.comm_wait_s:.3f} | {p.sent_per_step / 1e6:.2f} | {s.candidate.update} |"
    )


def _confirm(args: argparse.Namespace, ranked: list[Any], default: Any) -> list[dict[str, Any]]:
    """Trains the top candidates and the default for ``--steps`` steps each and prints predicted vs measured."""
    import tempfile

    from paratrain.bench.simulator import measured_step
    from paratrain.train.job import TrainJob
    from paratrain.train.record import merge_run
    from paratrain.train.run import run_training

    picks = [s for s in ranked[: args.confirm]]
    if default not in picks:
        picks.append(default)
    root = Path(tempfile.mkdtemp(prefix="paratrain-plan-"))
    rows = []
    network = {"bandwidth": args.bandwidth or None, "latency": args.latency or None, "straggler": args.straggler}
    for i, s in enumerate(picks):
        job = TrainJob(
            model=args.model,
            dataset=args.dataset,
            workers=args.workers,
            batch_size=args.batch_size,
            epochs=1,
            steps_per_epoch=args.steps,
            run_dir=str(root / f"run{i}"),
            **network,
        ).replace(**s.train_settings())
        print(f"paratrain plan: running {s.candidate.label} for {args.steps} steps ...", file=sys.stderr, flush=True)
        summary = run_training(job)
        measured = measured_step(merge_run(summary["run_dir"]))
        rows.append({"configuration": s.candidate.label, "predicted_s": s.step_s, "measured_s": measured})
    base = next(r for r, s in zip(rows, picks, strict=True) if s is default)["measured_s"]
    print("| configuration | predicted step (s) | measured step (s) | error | measured vs default |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['configuration']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
            f"{r['predicted_s'] / r['measured_s'] - 1:+.1%} | {base / r['measured_s']:.2f}x |"
        )
    return rows


def _space(args: argparse.Namespace, model: ModelProfile, strategies: list[str]) -> list[Candidate]:
    """The configurations to search (the default always among them), saying on stderr why pipelines are not."""
    from paratrain.sim.search import Candidate, candidates

    space = [
        c
        for c in candidates(model, strategies=strategies, workers=args.workers, batch_size=args.batch_size)
        if c.update == "exact" or not args.exact
    ]
    if any(parse_strategy(s).pipelined for s in strategies) and not any(c.spec.pipelined for c in space):
        why = (
            f"{args.model} has fewer modules than {args.workers} stages"
            if model.modules and all(layer.module >= 0 for layer in model.layers)
            else f"the profile of {args.model} predates its module structure (run 'paratrain profile' again)"
        )
        print(f"paratrain plan: pipelines not searched: {why}", file=sys.stderr)
    if Candidate() not in space:
        space.append(Candidate())
    return space


def _print_ranking(args: argparse.Namespace, machine: str, ranked: list[Scored], default: Scored) -> None:
    """The table of the ``--top`` configurations (and the default's row), the pick and the command to run it."""
    from paratrain.sim.search import reason

    network = ", ".join(
        x
        for x in (
            args.bandwidth and f"{args.bandwidth} links",
            args.latency and f"{args.latency} latency",
            args.straggler and f"straggler {args.straggler}",
        )
        if x
    )
    print(
        f"{args.model}, {args.workers} workers x batch {args.batch_size}"
        + (f", {network}" if network else "")
        + f" on {machine!r}: {len(ranked)} configurations simulated"
    )
    print("| rank | configuration | step (s) | vs default | compute (s) | waiting (s) | MB sent per worker | update |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for i, s in enumerate(ranked[: args.top]):
        _row(i + 1, s, default)
    if default not in ranked[: args.top]:
        _row(ranked.index(default) + 1, default, default)
    print(f"pick: {reason(ranked[0], default)}")
    flags = " ".join(ranked[0].train_flags())
    print(f"run it: paratrain train --model {args.model} --workers {args.workers} {flags}")


def _trace_pick(
    path: str, profile: MachineProfile, model: ModelProfile, pick: Candidate, setting: dict[str, Any]
) -> None:
    """``--trace``: the pick's simulated step as a Chrome trace at ``path``."""
    from paratrain.sim.predict import predict

    traced = predict(
        profile,
        model,
        strategy=pick.strategy,
        servers=pick.servers,
        bucket_bytes=pick.bucket_bytes,
        overlap=pick.overlap,
        trace=True,
        compression=pick.compression or None,
        **setting,
    )
    Path(path).write_text(json.dumps(traced.replay.chrome_trace()))
    print(f"trace of the pick's simulated step: {path} (open in Perfetto or chrome://tracing)")
