"""Local process supervisor: start a job's processes, relay their output, and stop them all together.

A distributed job is only useful while all of its processes are alive: when one rank dies, the others block
forever in their next collective. The supervisor therefore treats the processes as one unit. It starts each
child in its own process group, copies their output line by line (prefixed, so the ranks can be told apart),
and as soon as one child fails, or the supervisor itself is asked to stop, it stops all of them: SIGTERM to
every process group, a grace period, then SIGKILL. Whatever happens, ``Supervisor.run()`` returns only after
every process in the children's groups is gone and all their output has been written out.

Why process groups: a child may start helpers of its own (data loaders, compilers, shells). Signalling the
whole group reaches them too, and because each group is also a new session, a Ctrl-C at the terminal reaches
only the supervisor, which then stops the children in order instead of leaving them to race each other.

A job may also be given a deadline: a hung rank (or a server loop that is not ours to instrument) is then
stopped like a failed one, so that a caller such as a benchmark never waits for ever and never has to hunt
down processes itself. It may also carry injected failures (the time kills of a kill schedule, :mod:`.kills`),
which it sends on time and announces. With a restart budget (:mod:`.restarts`, ``--max-restarts``) a failed child
is replaced instead, from a warm spare when one runs, and the job goes on. The output relay is in :mod:`.pump`,
the process-group helpers in :mod:`.groups`, the words for failures in :mod:`.failures`, the budget and the
replacement's environment in :mod:`.restarts`, the restarts themselves (and an elastic job's shrinking) in
:mod:`.replacing`, what a process to start is in :mod:`.specs`; here are the supervision loop, signal handlers
and cleanup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

from paratrain.errors import ConfigError
from paratrain.launch.failures import (
    ProcFailure,
    describe_failure,
    describe_returncode,
    describe_spawn_error,
    plural,
    signal_name,
)
from paratrain.launch.groups import die_with_parent, group_alive, signal_group
from paratrain.launch.pump import Pump, Stream
from paratrain.launch.replacing import Replacing
from paratrain.launch.specs import Child, ProcSpec, RestartPolicy
from paratrain.launch.wakeup import WakePipe

__all__ = ["EXIT_TIMED_OUT", "Outcome", "ProcFailure", "ProcSpec", "RestartPolicy", "Supervisor"]

#: The exit code of a job stopped at its deadline: what ``timeout(1)`` returns, and what a benchmark worker's own
#: watchdog exits with, so that a shell script reads both the same way.
EXIT_TIMED_OUT = 124

_TAG = "paratrain launch: "

# How long the supervision loop sleeps between checks when nothing wakes it. Child exits normally wake it
# at once (SIGCHLD on the main thread, end of output otherwise); this bound only matters when neither
# arrives, e.g. a child that closed its output and then exited while ``run()`` is not on the main thread.
_POLL_S = 0.2
# While waiting out the grace period we also watch grandchildren, whose exits send us no SIGCHLD, so poll
# faster: a stopped job should not linger for a whole ``_POLL_S`` after its last process is gone.
_GRACE_POLL_S = 0.05
# After the first failure, how long to wait for other children already on their way out (see _settle).
_SETTLE_S = 0.1
# After SIGKILL, death takes milliseconds; poll for it at that scale.
_KILL_POLL_S = 0.01
# After every child is reaped, their pipes normally reach end-of-file at once. A process that escaped the
# children's process groups (e.g. it called ``setsid``) may still hold a pipe open; wait this long for
# end-of-file, then take only what is already buffered (the pump spends a bounded time on it).
_DRAIN_TIMEOUT_S = 1.0
# Waiting for a SIGKILLed process can only block if it is stuck in the kernel (e.g. on a dead NFS mount).
_REAP_TIMEOUT_S = 5.0
# The shell's code for "command not found / could not be executed", used when a child cannot be spawned.
_SPAWN_FAILED_RC = 127


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a supervised job ended.

    Attributes:
        exit_code: 0 if every child exited 0; 130 or 143 if the supervisor was stopped by SIGINT or SIGTERM
            (the shell convention 128 + signal number); :data:`EXIT_TIMED_OUT` (124) if the job ran past its
            deadline; otherwise 1. A child's own exit code is not passed through because with several children
            there is no single right one; it is in ``first_failure``.
        first_failure: the child whose failure stopped the job, if any. Children that die because the
            supervisor stopped them are not failures.
        interrupted_by: ``"SIGINT"`` or ``"SIGTERM"`` if that signal is what stopped the job.
        timed_out: True if the job was stopped because it ran past its deadline.
    """

    exit_code: int
    first_failure: ProcFailure | None
    interrupted_by: str | None
    timed_out: bool = False


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Supervisor(Replacing):
    """Runs a set of processes as one job: all succeed, or all are stopped.

    A ``Supervisor`` runs once. Typical use::

        outcome = Supervisor(specs, grace_s=3.0).run()
        sys.exit(outcome.exit_code)

    Signals: while ``run()`` is active on the main thread it handles SIGINT and SIGTERM (stop the job) and
    SIGCHLD (notice a dead child at once); the previous handlers are restored when it returns. A SIGINT or
    SIGTERM that arrives while the children are already being stopped (after a failure, or a second Ctrl-C)
    skips the rest of the grace period and SIGKILLs them. Off the main thread Python cannot install signal
    handlers, so none are; the supervisor then notices dead children by the end of their output or by
    polling every 0.2 s.
    """

    def __init__(
        self,
        specs: Sequence[ProcSpec],
        *,
        grace_s: float = 3.0,
        deadline_s: float | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        on_exit: Sequence[Callable[[], None]] = (),
        restarts: RestartPolicy | None = None,
    ) -> None:
        """Prepares a supervisor; nothing is started before ``run()``.

        Args:
            specs: the processes to start, in order.
            grace_s: how long stopped children get between SIGTERM and SIGKILL to save state and exit.
            deadline_s: if given, the job is stopped like a failed one when it is still running this many
                seconds after ``run()`` started (then SIGTERM, ``grace_s``, SIGKILL as usual); None waits as
                long as the children run. Set it where nobody watches: benchmarks, tests, batch scripts.
            stdout: where the children's stdout goes (prefixed); ``sys.stdout`` at ``run()`` time if None.
            stderr: where the children's stderr and the supervisor's own messages go; ``sys.stderr`` at
                ``run()`` time if None.
            on_exit: called once each, in order, after every child is gone, whatever the outcome (e.g. to
                remove a rendezvous file). An exception in one is reported on stderr and the rest still run.
            restarts: restart failed essential children instead of stopping the job, while the budget lasts,
                from a warm spare when one runs (:mod:`.restarts`); the job still stops once it is spent.

        Raises:
            ConfigError: no specs, a spec with an empty command, a negative grace period, or a deadline that
                is not a positive number of seconds.
        """
        if not specs:
            raise ConfigError("no processes to supervise: give at least one ProcSpec")
        for spec in specs:
            if not spec.argv:
                raise ConfigError(f"{spec.name}: the command is empty; give the program to run")
        if not grace_s >= 0:  # also rejects NaN
            raise ConfigError(f"grace_s must be a number of seconds >= 0, got {grace_s!r}")
        if deadline_s is not None and not deadline_s > 0:  # also rejects NaN
            raise ConfigError(f"deadline_s must be a number of seconds > 0 (or None for none), got {deadline_s!r}")
        self._specs = tuple(specs)
        self._grace_s = float(grace_s)
        self._deadline_s = None if deadline_s is None else float(deadline_s)
        self._deadline = float("inf")  # monotonic time at which the job is stopped; set by run()
        self._timed_out = False
        self._stdout = stdout
        self._stderr = stderr
        self._on_exit = tuple(on_exit)
        self._restarts = restarts
        self._replaced: set[int] = set()  # pids of failed children that a restart replaced
        self._finished: set[int] = set()  # pids of children seen to exit 0 (told to the restart policy)

        self._lock = threading.Lock()  # guards _children and _started (pids() may come from another thread)
        self._children: list[Child] = []
        self._started = False
        self._write_lock = threading.Lock()  # one line at a time on the output streams
        self._err: TextIO = sys.stderr
        self._out: TextIO = sys.stdout
        self._pump: Pump | None = None

        self._wake = WakePipe()  # wakes the supervision loop: signal handlers, the output thread

        self._signals: list[int] = []  # SIGINT/SIGTERM received, in order (appended by the handler)
        self._stop_signal: int | None = None  # the signal that stopped the job, if one did
        self._failure: ProcFailure | None = None
        self._tolerated: list[ProcFailure] = []  # non-essential children that failed while the job went on
        self._previous_handlers: dict[int, _Handler] = {}  # to restore when run() returns

    def pids(self) -> list[int]:
        """Returns the pids of the children started so far (each is also its process group id)."""
        with self._lock:
            return [child.popen.pid for child in self._children]

    def run(self) -> Outcome:
        """Starts every child, supervises them until the job ends, and cleans up.

        Blocks until all children are gone. Cleanup always happens, also when this raises: every child
        process group is stopped (SIGTERM, grace, SIGKILL) and then swept with SIGKILL, the children are
        reaped, their output is drained, the signal handlers are restored and the ``on_exit`` callbacks run.

        Returns:
            How the job ended.

        Raises:
            RuntimeError: ``run()`` was already called on this supervisor.
        """
        with self._lock:
            if self._started:
                raise RuntimeError("Supervisor.run() can be called only once; create a new Supervisor")
            self._started = True
        if self._deadline_s is not None:
            self._deadline = time.monotonic() + self._deadline_s
        out = self._stdout if self._stdout is not None else sys.stdout
        self._err = self._stderr if self._stderr is not None else sys.stderr
        self._wake.open()
        try:
            try:
                self._install_handlers()
                self._spawn_all()
                self._start_pump(out)
                if self._failure is None and self._stop_signal is None:
                    self._supervise()
            finally:
                self._shutdown(out)
        finally:
            self._restore_handlers()
            self._wake.close()
            self._run_on_exit()
        return self._outcome()

    # -- signals -------------------------------------------------------------------------------------------

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        handlers: list[tuple[int, Callable[[int, FrameType | None], None]]] = [
            (signal.SIGINT, self._on_stop_signal),
            (signal.SIGTERM, self._on_stop_signal),
        ]
        if hasattr(signal, "SIGCHLD"):
            handlers.append((signal.SIGCHLD, self._on_sigchld))
        for signum, handler in handlers:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, handler)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            # None means the old handler was not installed from Python and cannot be reinstated; the
            # default is the closest, and far better than leaving ours behind.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)
        self._wake.poke()

    def _on_sigchld(self, signum: int, frame: FrameType | None) -> None:
        self._wake.poke()

    # -- the job -------------------------------------------------------------------------------------------

    def _spawn_all(self) -> None:
        setup = die_with_parent()
        for spec in self._specs:
            if self._signals:
                self._note_stop_signal()
                return
            if self._spawn(spec, setup) is None:
                return

    def _spawn(self, spec: ProcSpec, setup: Callable[[], None] | None = None) -> Child | None:
        """Starts one child (None, with the failure recorded, if it cannot be started)."""
        try:
            # preexec_fn is documented as unsafe with threads because the child may run Python code
            # while another thread held a lock at fork time. Ours runs two system calls through a
            # function resolved beforehand, and the output thread only reads pipes.
            popen = subprocess.Popen(
                spec.argv,
                env=dict(spec.env),
                # A job's ranks must not compete for the terminal's input, and being in their own
                # sessions they could not use it properly anyway. A spare reads its orders from us.
                stdin=subprocess.PIPE if spec.spare else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=setup or die_with_parent(),  # noqa: PLW1509
            )
        except (OSError, subprocess.SubprocessError) as exc:
            cause = describe_spawn_error(spec.argv, exc)
            self._fail([ProcFailure(spec.name, 0, _SPAWN_FAILED_RC, cause)])
            return None
        child = Child(spec, popen)
        with self._lock:
            self._children.append(child)
        return child

    def _start_pump(self, out: TextIO) -> None:
        if self._pump is not None:
            return
        self._out = out
        streams: list[Stream] = []
        for child in self._children:
            streams += self._streams_of(child)
        # End of a child's output usually means the child has exited: wake the loop to look at once.
        self._pump = Pump(streams, self._write_lock, self._wake.poke_from_thread)
        self._pump.start()

    def _streams_of(self, child: Child) -> list[Stream]:
        streams = []
        for pipe, target in ((child.popen.stdout, self._out), (child.popen.stderr, self._err)):
            if pipe is not None:
                streams.append(Stream(pipe.fileno(), child.spec.prefix, target, bytearray()))
        child.streams = tuple(streams)
        return streams

    def _supervise(self) -> None:
        """Waits until every child has exited 0, an essential one has failed, a stop signal arrived, or the
        deadline passed."""
        started = time.monotonic()
        kills = sorted(
            ((started + c.spec.kill_after[0], i) for i, c in enumerate(self._children) if c.spec.kill_after),
        )
        while True:
            while kills and kills[0][0] <= time.monotonic():
                self._inject(self._children[kills.pop(0)[1]])
            if self._signals:
                self._note_stop_signal()
                return
            essential = {child.popen.pid for child in self._children if child.spec.essential}
            covered = {
                child.popen.pid
                for child in self._children
                if child.spec.restartable or (child.spec.restartable is None and child.spec.essential)
            }
            failed = self._newly_failed({f.pid for f in self._tolerated} | self._replaced)
            for failure in failed:
                if (
                    failure.pid not in essential
                    and failure.pid in covered
                    and self._restarts
                    and self._restart(failure)
                ):
                    continue
                if failure.pid not in essential:
                    self._tolerated.append(failure)
                    self._say(f"{describe_failure(failure)}; the others go on (it is not essential)")
            failed = [f for f in failed if f.pid in essential]
            if self._restarts is not None:
                self._note_finished()
            if failed and self._restarts is not None:
                failed = [f for f in failed if f.pid not in covered or not self._restart(f)]
            if failed:
                self._fail(self._settle(failed))
                return
            if self._count_running(spares=False) == 0:
                if self._count_running() == 0:
                    return
                self._release_spares()
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                self._note_deadline()
                return
            if kills:
                remaining = min(remaining, max(0.0, kills[0][0] - time.monotonic()))
            self._wake.wait(min(_POLL_S, remaining))

    def _inject(self, child: Child) -> None:
        """Sends a child its scheduled signal (a kill schedule's time kill), if it still runs, and says so."""
        assert child.spec.kill_after is not None
        _, signum, what = child.spec.kill_after
        if child.popen.poll() is not None:
            self._say(f"injected fault not sent: {child.spec.name} had already exited ({what})")
            return
        self._say(f"injected fault: {what}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.popen.pid, signum)

    def _newly_failed(self, known: set[int]) -> list[ProcFailure]:
        """The children, in spec order, that have exited non-zero and whose pid is not in ``known``."""
        failures = []
        for child in self._children:
            returncode = child.popen.poll()
            if returncode is not None and returncode != 0 and child.popen.pid not in known:
                cause = describe_returncode(returncode)
                failures.append(ProcFailure(child.spec.name, child.popen.pid, returncode, cause))
        return failures

    def _settle(self, failures: list[ProcFailure]) -> list[ProcFailure]:
        """Waits a moment for other children that are already on their way out, before stopping the rest.

        When one rank fails, its peers often fail *because* of it, and the order in which they finish
        dying says little about which came first: a rank that exits with an error may announce its exit to
        its peers, then spend longer tearing down than a peer takes to notice and die. Stopping the others
        at once would turn such a peer's real exit status into "killed by SIGTERM", hiding it. So collect
        the failures of the next ``_SETTLE_S`` seconds too and report them all; ``first_failure`` stays the
        first one observed.
        """
        deadline = time.monotonic() + _SETTLE_S
        while not self._signals and self._count_running() > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wake.wait(remaining)
            failures += self._newly_failed({failure.pid for failure in failures})
        return failures

    def _fail(self, failures: list[ProcFailure]) -> None:
        """Records the first failure and says, in one line, which children failed and what happens now."""
        self._failure = failures[0]
        parts = [describe_failure(failure) for failure in failures]
        parts[1:] = [f"also {part}" for part in parts[1:]]
        others = self._count_running()
        if others:
            parts.append(f"stopping the other {plural(others)}")
        self._say("; ".join(parts))

    def _note_stop_signal(self) -> None:
        self._stop_signal = self._signals[0]
        running = self._count_running()
        tail = f"; stopping {plural(running)}" if running else ""
        self._say(f"received {signal_name(self._stop_signal)}{tail}")

    def _note_deadline(self) -> None:
        self._timed_out = True
        running = self._count_running()
        self._say(f"still running after the job's deadline of {self._deadline_s:g} s; stopping {plural(running)}")

    def _count_running(self, *, spares: bool = True) -> int:
        return sum(1 for child in self._children if child.popen.poll() is None and (spares or not child.spec.spare))

    # -- cleanup -------------------------------------------------------------------------------------------

    def _shutdown(self, out: TextIO) -> None:
        self._start_pump(out)  # in case spawning raised before the pump was started
        self._stop_groups()
        # Final sweep: the groups stopped above are empty, but a group whose leader exited 0 earlier may
        # still hold processes that escaped the check in a race. SIGKILL to an empty group is harmless.
        for child in self._children:
            signal_group(child.popen.pid, signal.SIGKILL)
        self._await_groups_gone()
        assert self._pump is not None
        if self._pump.finish(_DRAIN_TIMEOUT_S):
            for child in self._children:
                for pipe in (child.popen.stdout, child.popen.stderr):
                    if pipe is not None:
                        pipe.close()
        else:
            self._say("some output could not be relayed: a process outside the job still writes to it")

    def _stop_groups(self) -> None:
        """SIGTERMs every child process group still running, waits for them, SIGKILLs those that stay."""
        for child in self._children:
            child.popen.poll()
        alive = [child for child in self._children if group_alive(child.popen.pid)]
        if not alive:
            return
        for child in alive:
            signal_group(child.popen.pid, signal.SIGTERM)
        # A signal beyond the one that stopped the job means "hurry up": skip the rest of the grace period.
        signals_seen = 1 if self._stop_signal is not None else 0
        deadline = time.monotonic() + self._grace_s
        while True:
            for child in alive:
                child.popen.poll()  # reap the leader, so that it no longer counts as a member of its group
            alive = [child for child in alive if group_alive(child.popen.pid)]
            if not alive:
                return
            names = ", ".join(child.spec.name for child in alive)
            if len(self._signals) > signals_seen:
                again = signal_name(self._signals[-1])
                self._say(f"received {again} again; sending SIGKILL to the processes of {names}")
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                grace = f"{self._grace_s:g} s"
                self._say(f"the processes of {names} did not stop within {grace} of SIGTERM; sending SIGKILL")
                break
            self._wake.wait(min(_GRACE_POLL_S, remaining))
        for child in alive:
            signal_group(child.popen.pid, signal.SIGKILL)

    def _await_groups_gone(self) -> None:
        """Reaps the children and waits until nothing in their groups runs any more.

        SIGKILL is delivered asynchronously: a grandchild may still be running for a moment after
        ``killpg`` returns. Returning before it is gone would break the promise that ``run()`` leaves
        nothing behind (and an ``on_exit`` callback could race with it), so wait, briefly and bounded.
        """
        deadline = time.monotonic() + _REAP_TIMEOUT_S
        for child in self._children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(max(0.0, deadline - time.monotonic()))
        while True:
            alive = [child for child in self._children if group_alive(child.popen.pid)]
            if not alive:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(child.spec.name for child in alive)
                self._say(
                    f"the processes of {names} did not die within {_REAP_TIMEOUT_S:g} s of SIGKILL "
                    "(stuck in the kernel, e.g. on a dead network mount?); giving up on them"
                )
                return
            self._wake.wait(_KILL_POLL_S)

    def _run_on_exit(self) -> None:
        for callback in self._on_exit:
            try:
                callback()
            except Exception:
                name = getattr(callback, "__qualname__", repr(callback))
                self._say(f"on_exit callback {name} failed (continuing):\n{traceback.format_exc().rstrip()}")

    def _outcome(self) -> Outcome:
        if self._stop_signal is not None:
            return Outcome(128 + self._stop_signal, self._failure, signal_name(self._stop_signal))
        if self._timed_out:
            return Outcome(EXIT_TIMED_OUT, self._failure, None, timed_out=True)
        if self._failure is not None:
            return Outcome(1, self._failure, None)
        if self._tolerated:
            return Outcome(1, self._tolerated[0], None)
        return Outcome(0, None, None)

    def _say(self, message: str) -> None:
        """Writes one line of the supervisor's own on its stderr."""
        with self._write_lock, contextlib.suppress(OSError, ValueError):
            self._err.write(f"{_TAG}{message}\n")
            self._err.flush()
