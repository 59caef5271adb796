"""``paratrain profile``: measure this machine's message paths and models' layers into a simulator profile (JSON).

What it measures and how: :mod:`paratrain.bench.profile`; the file's format: :mod:`paratrain.sim.machine`. The
measurements load the cores (two processes ping-pong; N processes train), so run it on an otherwise idle machine:
another job's load shows up in every number.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from paratrain.cli.errors import reports_config_errors
from paratrain.errors import ConfigError
from paratrain.sim.machine import MachineProfile

__all__ = ["add_parser", "format_table", "parse_sizes"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``profile`` on the ``paratrain`` parser."""
    p = sub.add_parser(
        "profile",
        help="measure this machine (message paths, reduce speed, models' layers) for the simulator",
        description=(
            "Measure the latency and bandwidth of each message path between two processes of this machine (ipc, "
            "tcp, the shared-memory collectives, links emulated by the fault injector), the speed of a reduce "
            "and a copy, and optionally each layer's forward and backward time of paratrain train's models; "
            "print a table and write the machine profile (JSON) that the simulator reads."
        ),
    )
    p.add_argument("--out", default="machine.json", help="the profile to write (default machine.json)")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="M",
        help="also profile this paratrain train model's layers (repeatable; default none: only the paths)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="examples per worker per step of the models (64)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="profile the models in N processes at once, sharing the cores as the N workers of a job here do, "
        "each with the threads such a job gives it, and time ipc and the fault injector under that load: N "
        "processes in a ring exchange (paths ipc@N, injected@N; default 1)",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="the models' input, as paratrain train --dataset (default: digits, fortunes for the transformer)",
    )
    p.add_argument("--data-dir", default=None, help="where the dataset's files are, as paratrain train --data-dir")
    p.add_argument(
        "--paths",
        default="ipc,tcp,shm",
        help="paths to measure, comma-separated: ipc, tcp, shm (default all three; '' for none)",
    )
    p.add_argument(
        "--emulate",
        action="append",
        default=[],
        metavar="SPEC",
        help="also measure a link emulated by the fault injector, e.g. 100Mbit or latency=1ms,bandwidth=1Gbit "
        "(repeatable); saved as the path 'emulated:SPEC'",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="message sizes, comma-separated, e.g. 0,1KiB,1MiB (default 0,1KiB,64KiB,1MiB,4MiB,16MiB; an "
        "emulated link keeps those it carries in about 20 ms)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps: a rough profile in seconds")
    p.add_argument(
        "--update",
        action="store_true",
        help="merge into the existing --out file: keep its other paths, models and cluster, replace what was "
        "measured again",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds each measuring job may run before it is stopped (300)"
    )
    p.set_defaults(func=_main)


def parse_sizes(text: str) -> list[int]:
    """Message sizes for ``--sizes``: ``0`` and what :func:`paratrain.bench.harness.parse_size` reads.

    Raises:
        ConfigError: a bad size, or fewer than two distinct sizes (a line needs two points).

    Example:
        >>> parse_sizes("0, 1KiB, 1MiB")
        [0, 1024, 1048576]
    """
    from paratrain.bench.harness import parse_size

    sizes: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            sizes.add(0 if part == "0" else parse_size(part))
        except ValueError as exc:
            raise ConfigError(f"--sizes: {exc}") from None
    if len(sizes) < 2:
        raise ConfigError(f"--sizes {text!r}: give at least two distinct sizes, e.g. 0,1MiB")
    return sorted(sizes)


def format_table(machine: MachineProfile) -> str:
    """What was measured, for people: each path's latency and bandwidth, then each model's layers."""
    lines = [f"{'path':<28} {'alpha (us)':>11} {'bandwidth (MB/s)':>17}"]
    for name, link in sorted(machine.paths.items()):
        bandwidth = f"{1 / link.beta / 1e6:17.1f}" if link.beta > 0 else f"{'unlimited':>17}"
        lines.append(f"{name:<28} {link.alpha * 1e6:11.1f} {bandwidth}")
    lines.append(
        f"reduce (np.add, float32): {1 / machine.gamma / 1e6:.0f} MB/s; copy: {1 / machine.copy / 1e6:.0f} MB/s"
        if machine.gamma > 0 and machine.copy > 0
        else "reduce and copy: not measured"
    )
    for key, model in sorted(machine.models.items()):
        lines.append("")
        lines.append(
            f"model {key}: step {model.compute_s * 1e3:.2f} ms = layers "
            f"{sum(x.forward_s + x.backward_s for x in model.layers) * 1e3:.2f} + optimizer "
            f"{model.optimizer_s * 1e3:.2f} + other {model.overhead_s * 1e3:.2f}; {model.param_bytes / 1e6:.2f} MB "
            "of parameters"
        )
        shares = model.cores()
        if shares is not None:
            lines.append(
                f"  one process alone: {model.alone_s * 1e3:.2f} ms a step; the {model.concurrency} processes shared "
                f"the cores as {shares[0]:.2f} cores' worth"
            )
        lines.append(f"  {'layer':<20} {'fwd (ms)':>9} {'bwd (ms)':>9} {'params (KB)':>12} {'output (KB)':>12}")
        for layer in model.layers:
            lines.append(
                f"  {layer.name:<20} {layer.forward_s * 1e3:9.3f} {layer.backward_s * 1e3:9.3f} "
                f"{sum(layer.param_bytes) / 1e3:12.1f} {layer.output_bytes / 1e3:12.1f}"
            )
    return "\n".join(lines)


def _merge(old: MachineProfile, new: MachineProfile) -> MachineProfile:
    """``new`` measured into ``old``: old paths and models kept unless measured again; old name and cluster."""
    return MachineProfile(
        name=old.name,
        paths={**old.paths, **new.paths},
        gamma=new.gamma,
        copy=new.copy,
        models={**old.models, **new.models},
        cluster=old.cluster,
        notes="\n".join(n for n in (old.notes, new.notes) if n),
    )


def _paths(text: str) -> list[str]:
    if text.strip().lower() == "none":
        return []
    return [p.strip() for p in text.split(",") if p.strip()]


@reports_config_errors("profile")
def _main(args: argparse.Namespace) -> int:
    from paratrain.bench.profile import DEFAULT_SIZES, ProfileError, measure_machine

    def say(line: str) -> None:
        print(f"paratrain profile: {line}", file=sys.stderr, flush=True)

    out = Path(args.out)
    try:
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
        if args.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {args.workers}")
        if args.timeout <= 0:
            raise ConfigError(f"--timeout must be positive, got {args.timeout}")
        old = MachineProfile.load(out) if args.update and out.exists() else None
        sizes: Sequence[int] = parse_sizes(args.sizes) if args.sizes is not None else DEFAULT_SIZES
        machine = measure_machine(
            paths=_paths(args.paths),
            emulate=args.emulate,
            models=args.model,
            batch_size=args.batch_size,
            concurrency=args.workers,
            dataset=args.dataset,
            data_dir=args.data_dir,
            sizes=sizes,
            quick=args.quick,
            timeout=args.timeout,
            say=say,
        )
    except ProfileError as exc:
        print(f"paratrain profile: failed: {exc}", file=sys.stderr)
        return 1
    if old is not None:
        machine = _merge(old, machine)
    print(format_table(machine))
    try:
        machine.save(out)
    except OSError as exc:
        print(f"paratrain profile: error: cannot write {str(out)!r}: {exc}; choose another --out", file=sys.stderr)
        return 2
    print(f"profile: {out}{' (updated)' if old is not None else ''}")
    return 0
