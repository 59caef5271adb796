"""The environment of every process of a local job: torchrun's variables, paratrain's, and a share of the cores."""

from __future__ import annotations

import os
from collections.abc import Mapping

from paratrain.launch.plan import LaunchPlan

__all__ = ["child_environments", "process_environment"]


def process_environment(base: Mapping[str, str], *, processes: int) -> dict[str, str]:
    """``base`` plus what every process of a local job needs, launched by paratrain or not (Gloo, MPI).

    Output unbuffered, so that lines reach the relay (and the user) as they are written, not at exit; and,
    unless ``base`` already sets it, ``OMP_NUM_THREADS`` = this host's cores / ``processes``, so that the
    processes' thread pools do not oversubscribe the cores they share.

    Example:
        >>> process_environment({"OMP_NUM_THREADS": "3"}, processes=2)
        {'OMP_NUM_THREADS': '3', 'PYTHONUNBUFFERED': '1'}
    """
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(processes, 1))))
    return env


def child_environments(plan: LaunchPlan, base: Mapping[str, str]) -> list[dict[str, str]]:
    """The environment of every process, workers then servers: ``base`` plus torchrun and paratrain variables.

    Workers see ``WORLD_SIZE`` = the number of workers (as torch code expects); servers get
    ``PARATRAIN_ROLE=server`` and ``RANK`` = their index among the servers; everyone gets
    ``PARATRAIN_NUM_SERVERS``. The transport numbers servers after the workers. Every process gets the plan's
    ``PARATRAIN_SECRET`` (it replaces one ``base`` may carry: the secret is the job's, not the shell's).
    """
    envs = []
    total = plan.nproc + plan.servers
    for index in range(total):
        server = index >= plan.nproc
        rank = index - plan.nproc if server else index
        role_size = plan.servers if server else plan.nproc
        env = process_environment(base, processes=total)
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
            }
        )
        if plan.secret:
            env["PARATRAIN_SECRET"] = plan.secret
        if plan.faults is not None:
            env["PARATRAIN_FAULTS"] = plan.faults
        if plan.timeout is not None:
            env["PARATRAIN_TIMEOUT"] = str(plan.timeout)
        envs.append(env)
    return envs
