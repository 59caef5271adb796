"""``paratrain bench recovery``: killed workers, bitwise-equal results and recovery time vs torchrun."""

from __future__ import annotations

import argparse

from paratrain.cli.bench_common import print_report
from paratrain.cli.errors import reports_config_errors

__all__ = ["add_parsers"]


def add_parsers(bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        return print_report("recovery", server_restart.render(found), found, args.json, 0 if good else 1)
    if args.elastic:
        from paratrain.bench import elastic

        found = elastic.run_elastic_bench(
            elastic.KILL_STEPS[:1] if args.quick else elastic.KILL_STEPS, repeat=args.repeat or 1
        )
        good = found["fault_free_bitwise_equal"] and all(r["exit"] == 0 and r["ranks_equal"] for r in found["runs"])
        return print_report("recovery", elastic.render(found), found, args.json, 0 if good else 1)

    schedules = DEFAULT_SCHEDULES[:3] if args.quick else DEFAULT_SCHEDULES + COLD_SCHEDULES
    report = run_bench(
        schedules, every=args.checkpoint_every, torchrun_repeat=1 if args.quick else args.torchrun_repeat
    )
    code = 0 if all(r["bitwise_equal"] and r["no_rollback"] for r in report["schedules"]) else 1
    return print_report("recovery", render(report), report, args.json, code)
