"""``paratrain launch``: the command line over :func:`paratrain.launch.run_launch` (N local ranks, supervised)."""

from __future__ import annotations

import argparse

from paratrain.cli.errors import reports_config_errors
from paratrain.launch.kills import HELP as KILL_HELP
from paratrain.launch.run import run_launch

__all__ = ["add_parser"]

_EPILOG = """\
Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets
them, plus PARATRAIN_* variables (role, run id, rendezvous address, and PARATRAIN_SECRET: 32 random bytes made
per job, with which every connection of the job is authenticated). A first word 'python' or a script
ending in .py runs with the interpreter of paratrain itself. Output lines are prefixed with [rankK]:.
If any rank fails, the others are stopped (SIGTERM, then SIGKILL after --grace seconds) and launch exits 1
naming the rank and the cause (with --max-restarts the rank is restarted instead; with --min-workers an elastic
job goes on without it). Ctrl-C stops every rank and exits 130.

--kill injects failures on purpose (SIGKILL unless another signal is named), reproducibly: RANK@step=K fires as
the rank's K-th optimizer step begins (DistributedOptimizer.step, Pipe.step), RANK@2.5s is sent by launch.

examples:
  paratrain launch -n 4 -- python -m paratrain.examples.barriers
  paratrain launch -n 2 --kill 1@step=5 -- python train.py
  paratrain launch -n 3 --min-workers 2 --max-restarts 1 --no-spare --kill 1@checkpoint=2 \\
      -- python -m paratrain.examples.elastic --until-joined
  paratrain launch -n 2 --servers 2 --replicas 2 --max-restarts 1 --kill server0@2s \\
      -- python -m paratrain.examples.ps_restart
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers ``launch`` on the ``paratrain`` parser."""
    p = sub.add_parser(
        "launch",
        help="start N local ranks of a script and supervise them",
        description="Start N ranks of CMD on this host, connected by paratrain's rendezvous, and supervise them.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-n", "--nproc", type=int, default=2, help="number of worker processes (default 2)")
    p.add_argument(
        "--servers",
        type=int,
        default=0,
        help="parameter-server processes to start beside the workers (they run paratrain's server loop, not CMD)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="R",
        help="parameter servers holding each key chunk (primary-backup, default 1); with R >= 2 a dead server's "
        "chunks fail over to their backups and the job goes on",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="a failed worker does not stop the others (elastic parameter-server jobs); servers stay essential",
    )
    p.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("--master-port", type=int, default=0, help="MASTER_PORT for torch (default: a free port)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--faults", default=None, help="fault spec for every rank, e.g. latency=2ms,bandwidth=100Mbit")
    p.add_argument("--timeout", type=float, default=None, help="PARATRAIN_TIMEOUT of blocking calls (s)")
    p.add_argument("--kill", default=None, metavar="SCHEDULE", help=KILL_HELP)
    p.add_argument("--kill-seed", type=int, default=0, help="seed of --kill's random items (default 0)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart a failed worker (up to R times in all) while the others go on; the program must recover "
        "with paratrain.recovery, as paratrain train does (default 0: a failure stops the job). With --servers "
        "a restarted worker rejoins the servers at its clock (a KVStore does it; paratrain.ps.rejoin); with "
        "--replicas >= 2 it restarts dead parameter servers instead, each catching up from its chunks' other "
        "replicas",
    )
    p.add_argument(
        "--no-spare",
        action="store_true",
        help="with --max-restarts: start a restarted rank cold rather than from a warm spare process",
    )
    p.add_argument(
        "--min-workers",
        type=int,
        default=0,
        metavar="M",
        help="elastic job: a worker that fails with no warm spare ready is dropped and the others go on, "
        "renumbered, while M remain; with --max-restarts a cold replacement joins at their next checkpoint "
        "(the program must use paratrain.recovery, as paratrain train does; default 0: not elastic)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command each rank runs (after --)")
    p.set_defaults(func=_main)


@reports_config_errors("launch")
def _main(args: argparse.Namespace) -> int:
    return run_launch(
        args.cmd,
        nproc=args.nproc,
        grace=args.grace,
        master_port=args.master_port,
        prefix=not args.no_prefix,
        faults=args.faults,
        timeout=args.timeout,
        servers=args.servers,
        replicas=args.replicas,
        keep_going=args.keep_going,
        kills=args.kill,
        kill_seed=args.kill_seed,
        max_restarts=args.max_restarts,
        spare=not args.no_spare,
        min_workers=args.min_workers,
    )
