"""The launch library: plan a local job, give each process its environment, and run it supervised.

Modules, from the bottom up: :mod:`.plan` (what runs, ports, run id), :mod:`.env` (every process's
environment), :mod:`.groups` (process groups, parent-death ties), :mod:`.pump` (the output relay),
:mod:`.failures` (failures in words), :mod:`.wakeup` (the loop's signal-safe wake-up), :mod:`.procs` (the
supervisor) and :mod:`.run` (``run_launch`` and ``run_commands``, with a deadline). ``paratrain launch`` is a thin
command line over :func:`run_launch`; the benchmarks use :func:`run_launch` and :func:`run_commands`.
"""

from paratrain.launch.env import child_environments, process_environment
from paratrain.launch.plan import LaunchPlan, free_port, resolve_command
from paratrain.launch.procs import EXIT_TIMED_OUT, Outcome, ProcSpec, Supervisor
from paratrain.launch.run import run_commands, run_launch, sweep_run

__all__ = [
    "EXIT_TIMED_OUT",
    "LaunchPlan",
    "Outcome",
    "ProcSpec",
    "Supervisor",
    "child_environments",
    "free_port",
    "process_environment",
    "resolve_command",
    "run_commands",
    "run_launch",
    "sweep_run",
]
