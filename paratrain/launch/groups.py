"""Process groups and parent-death ties: how a job's processes are signalled together and never outlive us.

Every child of a job leads a process group (and a session) of its own, so one ``killpg`` reaches the helpers it
started too. Where the kernel can (Linux ``PR_SET_PDEATHSIG``), a child is also tied to the thread that started
it, so that a supervisor killed with SIGKILL, which cannot clean up, takes its children along.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "group_alive", "signal_group"]

_PR_SET_PDEATHSIG = 1

_Prctl = Callable[[int, int, int, int, int], int]


def _load_prctl() -> _Prctl | None:
    """Resolves ``prctl(2)`` once, in the parent.

    Doing it here rather than in the forked child matters: ``dlopen``/``dlsym`` take locks that another
    thread of the parent may have held at the moment of the fork, which could deadlock the child.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    prctl.restype = ctypes.c_int
    func: _Prctl = prctl
    return func


_PRCTL = _load_prctl()


def _child_setup(parent_pid: int, prctl: _Prctl) -> Callable[[], None]:
    """Builds the ``preexec_fn`` that ties a child's life to the supervisor's.

    If the supervisor is SIGKILLed (or crashes) it cannot clean up, and the children, being in sessions of
    their own, would run on as orphans holding GPUs and ports. ``PR_SET_PDEATHSIG`` makes the kernel
    SIGKILL the child when the supervisor's *thread* that started it exits; ``Supervisor.run()`` starts the
    children and stays in that thread until they are all gone, so this only fires when the supervisor dies.

    Args:
        parent_pid: the supervisor's pid, to detect that it died before the setting took effect.
        prctl: the resolved ``prctl`` function.

    Returns:
        A function to run in the child between fork and exec; it does two system calls and nothing else.
    """
    sigkill = int(signal.SIGKILL)

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent_pid:
            # The supervisor died between fork and prctl: the death signal will never come.
            os.kill(os.getpid(), sigkill)

    return setup


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` making a child die when this process dies (Linux), for any ``subprocess`` call.

    Tools that start helper processes outside a :class:`~paratrain.launch.procs.Supervisor` use it so that a
    killed parent (a test's timeout, say) leaves no orphan. Returns None where ``prctl`` is unavailable.

    Example:
        >>> import subprocess
        >>> subprocess.run(["true"], preexec_fn=die_with_parent(), check=True).returncode
        0
    """
    return _child_setup(os.getpid(), _PRCTL) if _PRCTL is not None else None


def signal_group(pgid: int, sig: int) -> None:
    """Sends ``sig`` to a process group, ignoring a group that is already gone."""
    # PermissionError can only mean the group id now belongs to someone else: not ours to signal.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Tells whether any process of group ``pgid`` is still running.

    ``killpg(pgid, 0)`` alone is not enough: it also succeeds while the group holds only zombies, and an
    orphaned grandchild stays a zombie for good where PID 1 does not reap (common in containers). Waiting
    for those would always cost the full grace period, so on Linux ``/proc`` decides which are running.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    running = _proc_group_running(pgid)
    return True if running is None else running


def _proc_group_running(pgid: int) -> bool | None:
    """Scans ``/proc`` for a live (non-zombie) member of ``pgid``; None when ``/proc`` cannot tell."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    wanted = str(pgid).encode()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may itself contain spaces or parentheses.
        fields = stat.rpartition(b")")[2].split()
        if len(fields) < 3:
            continue
        state, pgrp = fields[0], fields[2]
        if pgrp == wanted and state not in (b"Z", b"X"):
            return True
    return False
