"""A supervised run: start a job's processes under one deadline, stop them together, and clean up after them.

Two entry points over one :class:`~paratrain.launch.procs.Supervisor`: :func:`run_launch` starts N ranks of a
paratrain job (rendezvous hosted here, torchrun variables, parameter servers), and :func:`run_commands` runs any
list of commands, each with its own environment (Gloo or MPI processes, a one-process reference run). Both may
be given a deadline, past which every process group is stopped (SIGTERM, grace, SIGKILL), so that a caller such
as a benchmark never walks ``/proc`` or kills processes itself.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from paratrain.errors import ConfigError
from paratrain.launch.env import child_environments
from paratrain.launch.failures import explain_failure
from paratrain.launch.kills import Kill, kill_env, parse_kills, time_kill
from paratrain.launch.plan import LaunchPlan, free_port, resolve_command
from paratrain.launch.procs import Outcome, ProcSpec, Supervisor
from paratrain.launch.restarts import Membership, Restarts, spare_spec, write_join_round

if TYPE_CHECKING:
    from paratrain.transport.rendezvous import RendezvousServer

__all__ = ["run_commands", "run_launch", "sweep_run"]


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


def run_commands(
    commands: Sequence[tuple[Sequence[str], Mapping[str, str]]],
    *,
    deadline_s: float | None = None,
    grace_s: float = 3.0,
    stdout: TextIO | None = None,
) -> Outcome:
    """Runs ``(argv, env)`` commands together as one job: all succeed, or all are stopped; blocks until done.

    The processes are named ``process 0``, ``process 1``... in messages; their output is relayed unprefixed.
    ``env`` is each process's complete environment (see :func:`~paratrain.launch.env.process_environment`).

    Args:
        commands: what to run, in order; argv[0] is looked up on the PATH of its env.
        deadline_s: stop the job if it is still running this many seconds after it started (None: no limit).
        grace_s: seconds between SIGTERM and SIGKILL when stopping.
        stdout: where the processes' stdout goes (``sys.stdout`` if None); stderr goes to ``sys.stderr``.

    Returns:
        How the job ended: ``timed_out``, ``first_failure`` (a command that could not be started is a failure
        with exit code 127), ``interrupted_by`` (Ctrl-C stops the processes and is reported here).

    Example:
        >>> run_commands([(["true"], dict(os.environ))], deadline_s=30).exit_code
        0
    """
    specs = [
        ProcSpec(name=f"process {index}", argv=list(argv), env=dict(env), prefix="")
        for index, (argv, env) in enumerate(commands)
    ]
    return Supervisor(specs, grace_s=grace_s, deadline_s=deadline_s, stdout=stdout).run()


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
    replicas: int = 1,
    deadline_s: float | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    kills: str | None = None,
    kill_seed: int = 0,
    max_restarts: int = 0,
    spare: bool = True,
    min_workers: int = 0,
) -> int:
    """Starts ``nproc`` ranks of ``cmd``, supervises them, cleans up; returns the exit code for the shell.

    Args:
        cmd: the command every worker runs; 'python' or a ``.py`` file runs under this interpreter.
        nproc: worker processes.
        grace: seconds between SIGTERM and SIGKILL when stopping.
        master_port: ``MASTER_PORT`` for torch (0: a free port).
        prefix: prefix every output line with ``[rankK]: `` / ``[serverK]: ``.
        faults: a fault spec for every rank's transport, checked here once.
        timeout: ``PARATRAIN_TIMEOUT`` of the ranks' blocking calls (not a limit on the job; see ``deadline_s``).
        servers: parameter-server processes started beside the workers (they run ``paratrain.runtime.serve``).
        replicas: parameter servers holding each chunk (``PARATRAIN_PS_REPLICAS``); above 1 a server's death
            does not stop the job: its chunks fail over to their backups (:mod:`paratrain.ps.server`).
        keep_going: a failed worker does not stop the others; servers stay essential.
        deadline_s: stop the whole job if it still runs this many seconds after it started (None: no limit).
        stdout: where the ranks' stdout goes (``sys.stdout`` if None).
        stderr: where the ranks' stderr and the launcher's own messages go (``sys.stderr`` if None).
        kills: a kill schedule (:mod:`paratrain.launch.kills`): failures injected on purpose.
        kill_seed: the seed of the schedule's ``random`` items.
        max_restarts: restart a failed worker up to this many times in all while the others go on (they must
            recover with :mod:`paratrain.recovery`, as ``paratrain train --max-restarts`` does); 0: a failure
            stops the job. With ``servers`` a worker's replacement rejoins the servers (:mod:`paratrain.ps.rejoin`),
            and with ``replicas`` >= 2 dead servers are restarted too (the same budget), each of which catches up
            from the other replicas of its chunks (:mod:`paratrain.ps.resync`).
        spare: with ``max_restarts``, keep a warm spare running that takes over a failed rank (:mod:`.restarts`).
        min_workers: above 0 the job is elastic: a worker that fails with no warm spare ready is dropped and the
            others go on (renumbered) while at least this many remain; a cold replacement (``max_restarts``)
            joins at their next checkpoint (:mod:`paratrain.recovery`).

    Every process of the job (and every spare and restarted rank: they copy a rank's environment) gets the job's
    ``PARATRAIN_SECRET``, 32 random bytes made here, so the rendezvous hosted here and every rank accept only
    each other (:mod:`paratrain.transport.auth`).

    Returns:
        0 if every process exited 0; 124 (:data:`~paratrain.launch.procs.EXIT_TIMED_OUT`) if the deadline
        stopped the job; 130 or 143 if SIGINT or SIGTERM did; otherwise 1.

    Raises:
        ConfigError: a bad argument or fault spec, or no command.
    """
    from paratrain.transport.auth import new_secret

    _check_options(
        nproc=nproc, servers=servers, replicas=replicas, grace=grace, max_restarts=max_restarts,
        keep_going=keep_going, min_workers=min_workers,
    )  # fmt: skip
    if faults:
        from paratrain.transport.faults import FaultSpec

        FaultSpec.parse(faults)  # refuse a bad spec here, once, not in every rank
    schedule = parse_kills(kills, nproc=nproc, servers=servers, seed=kill_seed) if kills else []
    argv = resolve_command(cmd)
    run_id = secrets.token_hex(4)
    secret = new_secret()  # per job: every rank, server and spare gets it; nothing else can join or send
    scratch = tempfile.mkdtemp(prefix=f"paratrain-{run_id}-")
    server = _rendezvous(nproc + servers, scratch, secret, servers=servers, max_restarts=max_restarts,
                         min_workers=min_workers)  # fmt: skip
    try:
        plan = LaunchPlan(
            nproc=nproc,
            argv=argv,
            run_id=run_id,
            master_port=master_port or free_port(),
            rdzv_port=server.port,
            scratch_dir=scratch,
            faults=faults,
            timeout=timeout,
            servers=servers,
            secret=secret.hex(),
        )
        server.start()
        specs = _proc_specs(
            plan, schedule, prefix=prefix, replicas=replicas, max_restarts=max_restarts, min_workers=min_workers,
            keep_going=keep_going,
        )  # fmt: skip
        restarts = _restarts(specs, server, prefix=prefix, spare=spare, max_restarts=max_restarts,
                             min_workers=min_workers)  # fmt: skip
        outcome = Supervisor(
            specs, grace_s=grace, deadline_s=deadline_s, stdout=stdout, stderr=stderr, restarts=restarts
        ).run()
        outcome = _report(outcome, scratch, replicas=replicas, keep_going=keep_going)
    finally:
        server.close()
        sweep_run(run_id, scratch)
    return outcome.exit_code


def _rendezvous(
    world_size: int, scratch: str, secret: bytes, *, servers: int, max_restarts: int, min_workers: int
) -> RendezvousServer:
    """The job's rendezvous on this host: rounds for restarted workers and elastic jobs (whose joiners are announced
    in ``scratch``), rejoins for restarted servers, open to this job's ``secret`` only."""
    from paratrain.transport.rendezvous import RendezvousServer

    return RendezvousServer(
        world_size=world_size,
        bind_addr="127.0.0.1",
        port=0,
        timeout=24 * 3600.0,
        rounds=(max_restarts > 0 and not servers) or min_workers > 0,
        elastic=min_workers > 0,
        rejoins=max_restarts > 0 and servers > 0,  # a restarted server takes its rank's place, nobody re-meets
        on_joiner=(lambda round_number: write_join_round(scratch, round_number)) if min_workers else None,
        secret=secret,
    )


def _restarts(
    specs: list[ProcSpec],
    server: RendezvousServer,
    *,
    prefix: bool,
    spare: bool,
    max_restarts: int,
    min_workers: int,
) -> Restarts | None:
    """The restart policy of a job that restarts or shrinks (None otherwise); its warm spare, if any, is added to
    ``specs``."""
    if not (max_restarts or min_workers):
        return None
    restarts = Restarts(
        max_restarts,
        spare_spec(specs[0], prefix=prefix) if spare and max_restarts and specs[0].restartable is not False else None,
        membership=Membership(min_workers, server) if min_workers else None,
        rendezvous=server,
    )
    if restarts.spare is not None:
        specs.append(restarts.spare)
    return restarts


def _check_options(
    *, nproc: int, servers: int, replicas: int, grace: float, max_restarts: int, keep_going: bool, min_workers: int
) -> None:
    """Refuses what :func:`run_launch` cannot run, saying which flag to change (before anything starts)."""
    if nproc < 1:
        raise ConfigError(f"-n must be at least 1, got {nproc}")
    if servers < 0:
        raise ConfigError(f"--servers must be >= 0, got {servers}")
    if replicas < 1 or (replicas > 1 and replicas > servers):
        raise ConfigError(f"--replicas {replicas} needs at least as many --servers (got {servers})")
    if grace < 0:
        raise ConfigError(f"--grace must be >= 0, got {grace}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if max_restarts and keep_going:
        raise ConfigError(
            "--max-restarts restarts failed processes; it does not combine with --keep-going (an elastic job, "
            "--min-workers, shrinks rather than restarts)"
        )
    if not 0 <= min_workers <= nproc:
        raise ConfigError(f"--min-workers must be between 0 and -n ({nproc}), got {min_workers}")
    if min_workers and (servers or keep_going):
        raise ConfigError(
            "--min-workers makes an allreduce job elastic; it does not combine with --servers (replicate the "
            "servers instead) or --keep-going"
        )


def _proc_specs(
    plan: LaunchPlan,
    schedule: list[Kill],
    *,
    prefix: bool,
    replicas: int,
    max_restarts: int,
    min_workers: int,
    keep_going: bool,
) -> list[ProcSpec]:
    """The processes of ``plan``: its workers (``plan.argv``) and parameter servers, each with its environment
    (the job's, the kills scheduled for it, the recovery settings) and what its failure means to the job."""
    servers, argv = plan.servers, plan.argv
    specs = []
    for index, base_env in enumerate(child_environments(plan, os.environ)):
        role, number = ("rank", index) if index < plan.nproc else ("server", index - plan.nproc)
        env = {**base_env, **kill_env(schedule, role, number)}
        if replicas > 1:
            env["PARATRAIN_PS_REPLICAS"] = str(replicas)
        if max_restarts and not servers:
            env["PARATRAIN_MAX_RESTARTS"] = str(max_restarts)
        elif max_restarts:  # a replacement rejoins the servers, nobody else re-forms
            env["PARATRAIN_PS_WORKER_RESTARTS"] = "1"
        if min_workers:
            env["PARATRAIN_MIN_WORKERS"] = str(min_workers)
        worker = role == "rank"
        specs.append(
            ProcSpec(
                name=f"{role} {number}",
                argv=argv if worker else [sys.executable, "-m", "paratrain.runtime.serve"],
                env=env,
                prefix=f"[{role}{number}]: " if prefix else "",
                # a replicated server is not essential (its chunks fail over, the job goes on), and a restarted
                # one catches up (ps.resync) while the budget lasts; an unreplicated one's chunks die with it; a
                # restarted worker rejoins the servers (ps.rejoin), replicated or not
                essential=not keep_going if worker else replicas == 1,
                kill_after=time_kill(schedule, role, number),
                restartable=None if worker else replicas > 1,
            )
        )
    return specs


def _report(outcome: Outcome, scratch: str, *, replicas: int, keep_going: bool) -> Outcome:
    """The job's outcome as the shell should see it, said on the launcher's stderr: a replicated server's death
    the job survived is a success; any other failure is explained (:mod:`paratrain.launch.failures`)."""
    lost = outcome.first_failure
    if replicas > 1 and not keep_going and outcome.exit_code == 1 and lost and lost.name.startswith("server "):
        # only servers failed (workers are essential): their chunks' backups took over
        print(
            f"paratrain launch: {lost.name} died; its chunks failed over to their backups "
            f"(--replicas {replicas}) and the job completed",
            file=sys.stderr,
            flush=True,
        )
        return Outcome(0, None, None)
    if lost is not None:
        note = explain_failure(lost.name, scratch)
        if note:
            print(f"paratrain launch: {note}", file=sys.stderr, flush=True)
    return outcome
