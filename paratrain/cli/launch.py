"""``paratrain launch``: start N local ranks with torchrun-compatible variables, and supervise them."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["LaunchPlan", "add_parser", "child_environments", "run_launch"]

_EPILOG = """\
Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets
them, plus PARATRAIN_* variables (role, run id, rendezvous address). A first word 'python' or a script
ending in .py runs with the interpreter of paratrain itself. Output lines are prefixed with [rankK]:.
If any rank fails, the others are stopped (SIGTERM, then SIGKILL after --grace seconds) and launch exits 1
naming the rank and the cause. Ctrl-C stops every rank and exits 130.

example:
  paratrain launch -n 4 -- python -m paratrain.examples.barriers
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
        "--keep-going",
        action="store_true",
        help="a failed worker does not stop the others (elastic parameter-server jobs); servers stay essential",
    )
    p.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("--master-port", type=int, default=0, help="MASTER_PORT for torch (default: a free port)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    p.add_argument("--faults", default=None, help="fault spec for every rank, e.g. latency=2ms,bandwidth=100Mbit")
    p.add_argument("--timeout", type=float, default=None, help="PARATRAIN_TIMEOUT of blocking calls (s)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command each rank runs (after --)")
    p.set_defaults(func=_main)


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """What ``launch`` will start: the command and the job-wide settings."""

    nproc: int
    argv: list[str]
    run_id: str
    master_port: int
    rdzv_port: int
    scratch_dir: str
    faults: str | None = None
    timeout: float | None = None
    servers: int = 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_command(cmd: Sequence[str]) -> list[str]:
    """The argv to run: 'python' means this interpreter; a ``.py`` file runs under it."""
    argv = list(cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ConfigError("no command given; usage: paratrain launch -n N -- CMD [ARGS...]")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    return argv


def child_environments(plan: LaunchPlan, base: Mapping[str, str]) -> list[dict[str, str]]:
    """The environment of every process, workers then servers: ``base`` plus torchrun and paratrain variables.

    Workers see ``WORLD_SIZE`` = the number of workers (as torch code expects); servers get
    ``PARATRAIN_ROLE=server`` and ``RANK`` = their index among the servers; everyone gets
    ``PARATRAIN_NUM_SERVERS``. The transport numbers servers after the workers.
    """
    envs = []
    total = plan.nproc + plan.servers
    threads = max(1, (os.cpu_count() or 1) // total)
    for index in range(total):
        server = index >= plan.nproc
        rank = index - plan.nproc if server else index
        role_size = plan.servers if server else plan.nproc
        env = dict(base)
        env.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(plan.nproc),
                "LOCAL_RANK": str(index),
                "LOCAL_WORLD_SIZE": str(total),
                "GROUP_RANK": "0",
                "ROLE_NAME": "server" if server else "worker",
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(role_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(plan.master_port),
                "PARATRAIN_LAUNCHER": "1",
                "PARATRAIN_ROLE": "server" if server else "worker",
                "PARATRAIN_NUM_SERVERS": str(plan.servers),
                "PARATRAIN_RUN_ID": plan.run_id,
                "PARATRAIN_RDZV_ADDR": "127.0.0.1",
                "PARATRAIN_RDZV_PORT": str(plan.rdzv_port),
                "PARATRAIN_RDZV_HOSTED": "1",
                "PARATRAIN_SCRATCH_DIR": plan.scratch_dir,
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if plan.faults is not None:
            env["PARATRAIN_FAULTS"] = plan.faults
        if plan.timeout is not None:
            env["PARATRAIN_TIMEOUT"] = str(plan.timeout)
        envs.append(env)
    return envs


def sweep_run(run_id: str, scratch_dir: str | None) -> None:
    """Removes what ranks of ``run_id`` may have left: the scratch directory and shared-memory segments."""
    if scratch_dir:
        shutil.rmtree(scratch_dir, ignore_errors=True)
    shm = "/dev/shm"
    if os.path.isdir(shm):
        for name in os.listdir(shm):
            if name.startswith(f"paratrain-{run_id}"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm, name))


def _lost_peers(scratch_dir: str, rank: int) -> list[tuple[int, str]]:
    path = os.path.join(scratch_dir, f"peer-lost.{rank}")
    try:
        with open(path, encoding="utf-8") as fh:
            entries = [line.rstrip("\n").split("\t", 1) for line in fh if "\t" in line]
    except OSError:
        return []
    return [(int(peer), why) for peer, why in entries if peer.isdigit()]


def explain_failure(name: str, scratch_dir: str) -> str | None:
    """Follows the chain "rank A failed after losing rank B, which lost rank C..." to where it started.

    Ranks record lost peers in the scratch directory (see ``runtime.context``). When the failed rank lost a
    peer first, the peer is the more likely root cause, and a user debugging the job should look there.
    """
    if not name.startswith("rank "):
        return None
    rank = int(name.split()[1])
    chain = [rank]
    while True:
        lost = _lost_peers(scratch_dir, chain[-1])
        if not lost or lost[0][0] in chain:
            break
        chain.append(lost[0][0])
    if len(chain) == 1:
        return None
    origin = chain[-1]
    steps = " -> ".join(f"rank {r}" for r in chain)
    return f"rank {rank} failed after losing a peer ({steps}); look first at rank {origin}'s output above"


def run_launch(
    cmd: Sequence[str],
    *,
    nproc: int,
    grace: float = 3.0,
    master_port: int = 0,
    prefix: bool = True,
    faults: str | None = None,
    timeout: float | None = None,
    servers: int = 0,
    keep_going: bool = False,
) -> int:
    """Starts ``nproc`` ranks of ``cmd``, supervises them, cleans up; returns the exit code for the shell."""
    from paratrain.launch.procs import ProcSpec, Supervisor
    from paratrain.runtime.rendezvous import RendezvousServer

    if nproc < 1:
        raise ConfigError(f"-n must be at least 1, got {nproc}")
    if servers < 0:
        raise ConfigError(f"--servers must be >= 0, got {servers}")
    if grace < 0:
        raise ConfigError(f"--grace must be >= 0, got {grace}")
    if faults:
        from paratrain.transport.faults import FaultSpec

        FaultSpec.parse(faults)  # refuse a bad spec here, once, not in every rank
    argv = resolve_command(cmd)
    run_id = secrets.token_hex(4)
    scratch = tempfile.mkdtemp(prefix=f"paratrain-{run_id}-")
    server = RendezvousServer(world_size=nproc + servers, bind_addr="127.0.0.1", port=0, timeout=24 * 3600.0)
    try:
        plan = LaunchPlan(
            nproc=nproc,
            argv=argv,
            run_id=run_id,
            master_port=master_port or _free_port(),
            rdzv_port=server.port,
            scratch_dir=scratch,
            faults=faults,
            timeout=timeout,
            servers=servers,
        )
        server.start()
        specs = []
        for index, env in enumerate(child_environments(plan, os.environ)):
            if index < nproc:
                specs.append(
                    ProcSpec(
                        name=f"rank {index}",
                        argv=argv,
                        env=env,
                        prefix=f"[rank{index}]: " if prefix else "",
                        essential=not keep_going,
                    )
                )
            else:
                s = index - nproc
                serve = [sys.executable, "-m", "paratrain.ps.serve"]
                specs.append(
                    ProcSpec(name=f"server {s}", argv=serve, env=env, prefix=f"[server{s}]: " if prefix else "")
                )
        outcome = Supervisor(specs, grace_s=grace).run()
        if outcome.first_failure is not None:
            note = explain_failure(outcome.first_failure.name, scratch)
            if note:
                print(f"paratrain launch: {note}", file=sys.stderr, flush=True)
    finally:
        server.close()
        sweep_run(run_id, scratch)
    return outcome.exit_code


def _main(args: argparse.Namespace) -> int:
    try:
        return run_launch(
            args.cmd,
            nproc=args.nproc,
            grace=args.grace,
            master_port=args.master_port,
            prefix=not args.no_prefix,
            faults=args.faults,
            timeout=args.timeout,
            servers=args.servers,
            keep_going=args.keep_going,
        )
    except ConfigError as exc:
        print(f"paratrain launch: error: {exc}", file=sys.stderr)
        return 2
