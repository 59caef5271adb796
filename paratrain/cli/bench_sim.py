"""``paratrain bench simulator`` and ``paratrain bench scaling``: the simulator against real runs, and beyond them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from paratrain.cli.errors import reports_config_errors
from paratrain.errors import ConfigError

__all__ = ["add_parsers"]


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None


def add_parsers(bench_sub: Any) -> None:
    """Registers both benchmarks under ``paratrain bench``."""
    p = bench_sub.add_parser(
        "simulator",
        help="predicted vs measured step time over strategies x models x emulated networks",
        description=(
            "For every model x network x strategy: train a few steps with paratrain train (real processes, the "
            "fault injector's links) and read the median step time, then predict the same step with the "
            "simulator from the machine profile and with the plain alpha-beta formula. Prints both errors, "
            "their median and worst, and each prediction's Spearman rank correlation with the measurements."
        ),
    )
    p.add_argument("--machine", default="machine.json", help="machine profile with every model profiled")
    p.add_argument("--models", type=_list, default=["mlp", "lenet", "widemlp"], help="default mlp,lenet,widemlp")
    p.add_argument(
        "--strategies",
        type=_list,
        default=["allreduce", "bsp"],
        help="default allreduce,bsp (also asp, sfb, poseidon:allreduce; allreduce+fp16 or +bf16 for compression)",
    )
    p.add_argument(
        "--networks", type=_list, default=["1Gbit", "100Mbit"], help="--bandwidth values (default 1Gbit,100Mbit)"
    )
    p.add_argument("--workers", type=int, default=4, help="workers per run (default 4)")
    p.add_argument("--steps", type=int, default=8, help="steps per run; the first two are not measured (default 8)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per worker and step (default 64)")
    p.add_argument("--dataset", default="fashion-mnist", help="dataset of the runs (default fashion-mnist)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the whole grid, interleaved (default 1)")
    p.add_argument(
        "--bucket-grid",
        default=None,
        metavar="SIZES",
        help="instead: allreduce of the first model on the first network with each of these fusion sizes "
        "(e.g. 256KiB,1MiB,4MiB,16MiB,64MiB), measured and predicted; reports how far the simulator's pick is from "
        "the best measured size",
    )
    p.add_argument(
        "--measured",
        default=None,
        metavar="JSON",
        action="append",
        help="instead of running: predict again the measurements of earlier reports (repeatable; they are "
        "merged), e.g. after a change to the simulator or the profile",
    )
    p.add_argument("--out", default=None, help="directory for the runs (default a temporary one)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    p.set_defaults(func=_simulator)

    s = bench_sub.add_parser(
        "scaling",
        help="simulated gradient exchange of 2 ... 1024 workers: ring, tree, central, sharded servers, gossip",
        description=(
            "Replays one exchange of --size bytes per worker for every N in --workers on a described cluster "
            "(one rank per host, links of --bandwidth and --latency) by the ring, the binomial tree, one central "
            "server, one server per 8 workers and a gossip round on the ring graph, from the runtime's plans. "
            "Prints seconds per exchange and how long each simulation took; --plot draws the figure."
        ),
    )
    s.add_argument("--size", default="100MB", help="bytes per worker, e.g. 100MB (default 100MB)")
    s.add_argument("--bandwidth", default="10Gbit", help="each host's link (default 10Gbit)")
    s.add_argument("--latency", default="10us", help="one-way latency (default 10us)")
    s.add_argument(
        "--workers", type=_ints, default=[2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], help="the Ns (default 2..1024)"
    )
    s.add_argument("--schemes", type=_list, default=None, help="subset of ring,tree,central,ps:N/8,gossip")
    s.add_argument(
        "--step",
        default=None,
        metavar="MODEL",
        help="instead: one training step of MODEL (profiled in --machine) with ring allreduce at every N, and how "
        "long simulating it took",
    )
    s.add_argument(
        "--check",
        action="store_true",
        help="instead: time the --algorithms allreduces of --size in N real processes here (the --workers, e.g. "
        "2,3,4) under the fault injector's --bandwidth and --latency, beside the same plans replayed on --machine",
    )
    s.add_argument("--repeat", type=int, default=3, help="with --check: rounds, N interleaved (default 3)")
    s.add_argument(
        "--links",
        default=None,
        metavar="FILE",
        help="with --check: pairs of ranks with links of their own (the fault injector's links=FILE JSON)",
    )
    s.add_argument(
        "--algorithms",
        type=_list,
        default=None,
        help="with --check: allreduce algorithms to time (default ring,tree,halving_doubling,torus,double_tree)",
    )
    s.add_argument("--machine", default="machine.json", help="with --step or --check: the machine profile")
    s.add_argument("--plot", default=None, help="write the figure (PNG) here")
    s.add_argument("--json", default=None, help="also write the report to this JSON file")
    s.set_defaults(func=_scaling)


def _emit(command: str, table: str, report: dict[str, Any], path: str | None) -> int:
    print(table, flush=True)
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
            fh.write("\n")
        print(f"wrote {path}")
    return 0


@reports_config_errors("bench simulator")
def _simulator(args: argparse.Namespace) -> int:
    from paratrain.bench.simulator import render_validation, run_validation
    from paratrain.sim.machine import MachineProfile

    if min(args.workers, args.steps - 2, args.batch_size, args.repeat) < 1:
        raise ConfigError("--workers, --batch-size and --repeat must be >= 1 and --steps >= 3")
    profile = MachineProfile.load(args.machine)
    for model in args.models:
        profile.model(model, args.batch_size, args.workers)  # fail now, not after an hour of runs
    networks = [None if n in ("", "none", "local") else n for n in args.networks]
    # every run's size, data and folder, the same in the grid and the bucket sweep
    runs: dict[str, Any] = {
        "workers": args.workers,
        "steps": args.steps,
        "batch": args.batch_size,
        "repeat": args.repeat,
        "dataset": args.dataset,
        "out_dir": args.out,
    }
    if args.measured:
        from paratrain.bench.simulator import measurements, predict_rows

        measured: dict[Any, list[float]] = {}
        for path in args.measured:
            with open(path, encoding="utf-8") as fh:
                measured.update(measurements(json.load(fh)))
        report = predict_rows(profile, measured, workers=args.workers, batch=args.batch_size)
        return _emit("simulator", render_validation(report), report, args.json)
    if args.bucket_grid:
        from paratrain.bench.simulator import render_bucket_grid, run_bucket_grid

        grid = run_bucket_grid(
            profile,
            model=args.models[0],
            network=networks[0],
            sizes=[_bytes(x) for x in _list(args.bucket_grid)],
            **runs,
        )
        return _emit("simulator", render_bucket_grid(grid), grid, args.json)
    report = run_validation(profile, models=args.models, strategies=args.strategies, networks=networks, **runs)
    return _emit("simulator", render_validation(report), report, args.json)


@reports_config_errors("bench scaling")
def _scaling(args: argparse.Namespace) -> int:
    from paratrain.bench.scaling import SCHEMES, plot_scaling, render_scaling, run_scaling
    from paratrain.config import parse_duration
    from paratrain.sim.machine import LinkCost
    from paratrain.transport.faults import parse_bandwidth

    nbytes = _bytes(args.size)
    link = LinkCost(parse_duration(args.latency), 1.0 / parse_bandwidth(args.bandwidth))
    if args.step:
        return _step_scaling(args, link)
    if args.check:
        return _check_scaling(args, nbytes)
    schemes = args.schemes or list(SCHEMES)
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise ConfigError(f"unknown scheme {', '.join(bad)}; choose from {', '.join(SCHEMES)}")
    report = run_scaling(nbytes=nbytes, link=link, workers=args.workers, schemes=schemes)
    if args.plot:
        plot_scaling(report, args.plot)
        print(f"figure: {args.plot}")
    return _emit("scaling", render_scaling(report), report, args.json)


def _bytes(text: str) -> int:
    """A size as the other benchmarks read it (:func:`paratrain.bench.harness.parse_size`)."""
    from paratrain.bench.harness import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _step_scaling(args: argparse.Namespace, link: Any) -> int:
    """``bench scaling --step MODEL``: a training step at every N, its simulated time and the simulation's."""
    import time

    from paratrain.bench.scaling import training_step
    from paratrain.sim.machine import MachineProfile

    profile = MachineProfile.load(args.machine)
    model = next((m for m in profile.models.values() if m.model == args.step), None)
    if model is None:
        raise ConfigError(
            f"{args.machine} has no profile of {args.step!r}; run 'paratrain profile --model {args.step}'"
        )
    rows = []
    for n in args.workers:
        t0 = time.perf_counter()
        p = training_step(profile, model, n, link)
        rows.append({"workers": n, "step_s": p.step_s, "simulated_in_s": time.perf_counter() - t0})
    lines = ["| N | simulated step | time to simulate it |", "|---:|---:|---:|"]
    lines += [f"| {r['workers']} | {r['step_s']:.3f} s | {r['simulated_in_s']:.3f} s |" for r in rows]
    report = {"benchmark": "scaling-step", "model": args.step, "alpha": link.alpha, "beta": link.beta, "rows": rows}
    return _emit("scaling", "\n".join(lines), report, args.json)


def _check_scaling(args: argparse.Namespace, nbytes: int) -> int:
    """``bench scaling --check``: allreduce algorithms at small N, measured here and simulated on the profile."""
    from paratrain.bench.scaling import CHECKED, check_scaling, render_check
    from paratrain.collectives.lower_allreduce import PLANNED_ALGORITHMS
    from paratrain.sim.machine import MachineProfile

    if args.repeat < 1:
        raise ConfigError(f"--repeat must be at least 1, got {args.repeat}")
    known = (*PLANNED_ALGORITHMS, *(["blink"] if args.links else []))
    unknown = [a for a in args.algorithms or () if a not in known]
    if unknown:
        raise ConfigError(f"--algorithms takes {', '.join(known)} (blink with --links); got {', '.join(unknown)}")
    profile = MachineProfile.load(args.machine)
    spec = ",".join(
        [f"bandwidth={args.bandwidth}"] + ([f"latency={args.latency}"] if args.latency not in ("0", "0s") else [])
    )
    try:
        report = check_scaling(
            profile,
            nbytes=nbytes,
            workers=args.workers,
            spec=spec,
            repeat=args.repeat,
            algorithms=args.algorithms or CHECKED,
            links=args.links,
            say=lambda line: print(f"paratrain bench scaling: {line}", file=sys.stderr),
        )
    except RuntimeError as exc:
        print(f"paratrain bench scaling: error: {exc}", file=sys.stderr)
        return 1
    return _emit("scaling", render_check(report), report, args.json)
