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
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import selectors
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

__all__ = ["Outcome", "ProcFailure", "ProcSpec", "Supervisor", "die_with_parent"]

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
# How long the output thread may block in ``select`` before it looks at its stop flag again.
_PUMP_POLL_S = 0.1
# After every child is reaped, their pipes normally reach end-of-file at once. A process that escaped the
# children's process groups (e.g. it called ``setsid``) may still hold a pipe open; wait this long for
# end-of-file, then take only what is already buffered, spending at most ``_DRAIN_BUDGET_S`` on it.
_DRAIN_TIMEOUT_S = 1.0
_DRAIN_BUDGET_S = 0.5
# A process that writes without ever writing a newline (progress bars redrawn with "\r") would otherwise
# make the supervisor buffer its output without bound; past this size the pending bytes go out as a line.
_MAX_PENDING = 1 << 16
_READ_SIZE = 1 << 16
# Waiting for a SIGKILLed process can only block if it is stuck in the kernel (e.g. on a dead NFS mount).
_REAP_TIMEOUT_S = 5.0
# The shell's code for "command not found / could not be executed", used when a child cannot be spawned.
_SPAWN_FAILED_RC = 127
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ProcSpec:
    """One process to start.

    Attributes:
        name: human name used in messages, e.g. ``"rank 2"``.
        argv: the command to run; ``argv[0]`` is looked up on the ``PATH`` of ``env``.
        env: the child's complete environment (nothing is inherited implicitly, so that what a rank sees
            is exactly what the launcher decided).
        prefix: prepended to every output line of this child, e.g. ``"[rank2]: "`` (``""`` for none).
        essential: if False, this child's failure is reported but does not stop the others (elastic jobs,
            where the survivors carry on without a lost worker); the job still ends with exit code 1.
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    prefix: str
    essential: bool = True


@dataclass(frozen=True, slots=True)
class ProcFailure:
    """A child that failed, and how.

    Attributes:
        name: the child's ``ProcSpec.name``.
        pid: its process id, or 0 if it could not be started.
        returncode: as ``Popen`` gives it: negative means killed by that signal; 127 means it could not be
            started.
        cause: what happened, in words, e.g. ``"exited with code 3"`` or ``"was killed by signal SIGKILL"``.
    """

    name: str
    pid: int
    returncode: int
    cause: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a supervised job ended.

    Attributes:
        exit_code: 0 if every child exited 0; 130 or 143 if the supervisor was stopped by SIGINT or SIGTERM
            (the shell convention 128 + signal number); otherwise 1. A child's own exit code is not passed
            through because with several children there is no single right one; it is in ``first_failure``.
        first_failure: the child whose failure stopped the job, if any. Children that die because the
            supervisor stopped them are not failures.
        interrupted_by: ``"SIGINT"`` or ``"SIGTERM"`` if that signal is what stopped the job.
    """

    exit_code: int
    first_failure: ProcFailure | None
    interrupted_by: str | None


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
    SIGKILL the child when the supervisor's *thread* that started it exits; ``run()`` starts the children
    and stays in that thread until they are all gone, so this only fires when the supervisor dies.

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

    Benchmarks and tools that start helper processes outside a :class:`Supervisor` use it so that a killed
    parent (a test's timeout, say) leaves no orphan. Returns None where ``prctl`` is unavailable.
    """
    return _child_setup(os.getpid(), _PRCTL) if _PRCTL is not None else None


def _describe_returncode(returncode: int) -> str:
    """Says in words how a child ended, e.g. ``"was killed by signal SIGKILL"``."""
    if returncode < 0:
        return f"was killed by signal {_signal_name(-returncode)}"
    cause = f"exited with code {returncode}"
    if returncode > 128 and _is_signal(returncode - 128):
        # Shells report a child killed by signal N as 128 + N; say so, since "137" alone means little.
        cause += f" (128 + {_signal_name(returncode - 128)}: probably killed by that signal)"
    return cause


def _is_signal(number: int) -> bool:
    try:
        signal.Signals(number)
    except ValueError:
        return False
    return True


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _describe_spawn_error(argv: Sequence[str], exc: BaseException) -> str:
    """Says why ``Popen`` could not start ``argv``, with a hint at the usual fix."""
    if isinstance(exc, FileNotFoundError):
        return f"could not be started: {exc.strerror}: {argv[0]!r} (is the command installed and on PATH?)"
    if isinstance(exc, PermissionError):
        return f"could not be started: {exc.strerror}: {argv[0]!r} (is the file executable?)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"could not be started: {exc.strerror}: {argv[0]!r}"
    return f"could not be started: {exc}"


def _describe_failure(failure: ProcFailure) -> str:
    """E.g. ``"rank 2 (pid 4242) exited with code 3"``; no pid for a child that could not be started."""
    who = f"{failure.name} (pid {failure.pid})" if failure.pid else failure.name
    return f"{who} {failure.cause}"


def _plural(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _signal_group(pgid: int, sig: int) -> None:
    """Sends ``sig`` to a process group, ignoring a group that is already gone."""
    # PermissionError can only mean the group id now belongs to someone else: not ours to signal.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
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


@dataclass(slots=True, eq=False)
class _Stream:
    """One pipe from a child, with the bytes read since its last newline."""

    fd: int
    prefix: str
    out: TextIO
    pending: bytearray


class _Pump:
    """A thread that copies the children's pipes to the supervisor's streams, one whole line at a time.

    One thread with ``selectors`` serves all pipes, so the cost does not grow with the number of ranks.
    Lines are written whole, under one lock shared with the supervisor's own messages, so lines of
    different children (and of the supervisor) never interleave mid-line.
    """

    def __init__(self, streams: list[_Stream], lock: threading.Lock, on_eof: Callable[[], None]) -> None:
        self._streams = streams
        self._lock = lock
        self._on_eof = on_eof
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-launch-output", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, timeout: float) -> bool:
        """Waits for end-of-file on every pipe, then settles for what is already buffered.

        Returns:
            True if the thread has ended (so the pipes may be closed).
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout + _DRAIN_BUDGET_S)
        return not self._thread.is_alive()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            for stream in self._streams:
                sel.register(stream.fd, selectors.EVENT_READ, stream)
            drain_deadline: float | None = None
            while sel.get_map():
                if self._stop.is_set():
                    # Asked to stop: take what is readable now, but do not chase a writer that never stops.
                    if drain_deadline is None:
                        drain_deadline = time.monotonic() + _DRAIN_BUDGET_S
                    events = sel.select(0)
                    if not events or time.monotonic() >= drain_deadline:
                        break
                else:
                    events = sel.select(_PUMP_POLL_S)
                for key, _ in events:
                    source: _Stream = key.data
                    if not self._read(source):
                        sel.unregister(source.fd)
                        self._on_eof()
        finally:
            sel.close()
            for stream in self._streams:
                if stream.pending:
                    self._emit(stream, bytes(stream.pending))
                    stream.pending.clear()

    def _read(self, stream: _Stream) -> bool:
        """Reads what is available on one pipe and writes out its complete lines; False at end-of-file."""
        try:
            data = os.read(stream.fd, _READ_SIZE)
        except OSError:
            data = b""
        if not data:
            if stream.pending:
                # A last line without a newline is still a line: the child's final words often are.
                self._emit(stream, bytes(stream.pending))
                stream.pending.clear()
            return False
        pending = stream.pending
        pending += data
        start = 0
        while (newline := pending.find(b"\n", start)) >= 0:
            self._emit(stream, bytes(pending[start : newline + 1]))
            start = newline + 1
        del pending[:start]
        if len(pending) >= _MAX_PENDING:
            self._emit(stream, bytes(pending))
            pending.clear()
        return True

    def _emit(self, stream: _Stream, raw: bytes) -> None:
        # Decoding whole lines (split on b"\n") never cuts a UTF-8 sequence in two; invalid bytes from a
        # child must not kill the relay, hence errors="replace".
        text = raw.decode("utf-8", errors="replace")
        if not text.endswith("\n"):
            text += "\n"
        # A closed or broken terminal must not stop the relay: the children would then block on full
        # pipes. Their output is lost, but they keep running and can still be stopped.
        with self._lock, contextlib.suppress(OSError, ValueError):
            stream.out.write(stream.prefix + text)
            stream.out.flush()


@dataclass(slots=True, eq=False)
class _Child:
    spec: ProcSpec
    popen: subprocess.Popen[bytes]


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Supervisor:
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
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        on_exit: Sequence[Callable[[], None]] = (),
    ) -> None:
        """Prepares a supervisor; nothing is started before ``run()``.

        Args:
            specs: the processes to start, in order.
            grace_s: how long stopped children get between SIGTERM and SIGKILL to save state and exit.
            stdout: where the children's stdout goes (prefixed); ``sys.stdout`` at ``run()`` time if None.
            stderr: where the children's stderr and the supervisor's own messages go; ``sys.stderr`` at
                ``run()`` time if None.
            on_exit: called once each, in order, after every child is gone, whatever the outcome (e.g. to
                remove a rendezvous file). An exception in one is reported on stderr and the rest still run.

        Raises:
            ConfigError: no specs, a spec with an empty command, or a negative grace period.
        """
        if not specs:
            raise ConfigError("no processes to supervise: give at least one ProcSpec")
        for spec in specs:
            if not spec.argv:
                raise ConfigError(f"{spec.name}: the command is empty; give the program to run")
        if not grace_s >= 0:  # also rejects NaN
            raise ConfigError(f"grace_s must be a number of seconds >= 0, got {grace_s!r}")
        self._specs = tuple(specs)
        self._grace_s = float(grace_s)
        self._stdout = stdout
        self._stderr = stderr
        self._on_exit = tuple(on_exit)

        self._lock = threading.Lock()  # guards _children and _started (pids() may come from another thread)
        self._children: list[_Child] = []
        self._started = False
        self._write_lock = threading.Lock()  # one line at a time on the output streams
        self._err: TextIO = sys.stderr
        self._pump: _Pump | None = None

        # Self-pipe that wakes the supervision loop. Signal handlers must not touch a threading.Event:
        # they run on the main thread between two bytecodes, possibly while that same thread holds the
        # Event's internal lock, and would deadlock. A non-blocking write to a pipe cannot.
        self._wake_r = -1
        self._wake_w = -1
        self._wake_lock = threading.Lock()  # so the output thread never writes to a closed (reused) fd

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
        out = self._stdout if self._stdout is not None else sys.stdout
        self._err = self._stderr if self._stderr is not None else sys.stderr
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
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
            self._close_wake_pipe()
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
        self._poke()

    def _on_sigchld(self, signum: int, frame: FrameType | None) -> None:
        self._poke()

    def _poke(self) -> None:
        """Wakes the supervision loop; safe in a signal handler (one non-blocking write, no locks)."""
        wake_w = self._wake_w
        if wake_w >= 0:
            # BlockingIOError: the pipe is full, so a wake-up is already pending.
            with contextlib.suppress(OSError):
                os.write(wake_w, b"\0")

    def _poke_from_thread(self) -> None:
        with self._wake_lock:
            self._poke()

    def _close_wake_pipe(self) -> None:
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _wait(self, timeout: float) -> None:
        """Sleeps until poked or until ``timeout`` seconds have passed."""
        if timeout <= 0:
            return
        readable, _, _ = select.select([self._wake_r], [], [], timeout)
        if readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 512):
                    pass

    # -- the job -------------------------------------------------------------------------------------------

    def _spawn_all(self) -> None:
        setup = die_with_parent()
        for spec in self._specs:
            if self._signals:
                self._note_stop_signal()
                return
            try:
                # preexec_fn is documented as unsafe with threads because the child may run Python code
                # while another thread held a lock at fork time. Ours runs two system calls through a
                # function resolved beforehand, and the output thread starts only after every spawn.
                popen = subprocess.Popen(
                    spec.argv,
                    env=dict(spec.env),
                    # A job's ranks must not compete for the terminal's input, and being in their own
                    # sessions they could not use it properly anyway.
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=setup,  # noqa: PLW1509
                )
            except (OSError, subprocess.SubprocessError) as exc:
                cause = _describe_spawn_error(spec.argv, exc)
                self._fail([ProcFailure(spec.name, 0, _SPAWN_FAILED_RC, cause)])
                return
            with self._lock:
                self._children.append(_Child(spec, popen))

    def _start_pump(self, out: TextIO) -> None:
        if self._pump is not None:
            return
        streams: list[_Stream] = []
        for child in self._children:
            for pipe, target in ((child.popen.stdout, out), (child.popen.stderr, self._err)):
                if pipe is not None:
                    streams.append(_Stream(pipe.fileno(), child.spec.prefix, target, bytearray()))
        # End of a child's output usually means the child has exited: wake the loop to look at once.
        self._pump = _Pump(streams, self._write_lock, self._poke_from_thread)
        self._pump.start()

    def _supervise(self) -> None:
        """Waits until every child has exited 0, an essential one has failed, or a stop signal arrived."""
        essential = {child.popen.pid for child in self._children if child.spec.essential}
        while True:
            if self._signals:
                self._note_stop_signal()
                return
            failed = self._newly_failed({f.pid for f in self._tolerated})
            for failure in failed:
                if failure.pid not in essential:
                    self._tolerated.append(failure)
                    self._say(f"{_describe_failure(failure)}; the others go on (it is not essential)")
            failed = [f for f in failed if f.pid in essential]
            if failed:
                self._fail(self._settle(failed))
                return
            if self._count_running() == 0:
                return
            self._wait(_POLL_S)

    def _newly_failed(self, known: set[int]) -> list[ProcFailure]:
        """The children, in spec order, that have exited non-zero and whose pid is not in ``known``."""
        failures = []
        for child in self._children:
            returncode = child.popen.poll()
            if returncode is not None and returncode != 0 and child.popen.pid not in known:
                cause = _describe_returncode(returncode)
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
            self._wait(remaining)
            failures += self._newly_failed({failure.pid for failure in failures})
        return failures

    def _fail(self, failures: list[ProcFailure]) -> None:
        """Records the first failure and says, in one line, which children failed and what happens now."""
        self._failure = failures[0]
        parts = [_describe_failure(failure) for failure in failures]
        parts[1:] = [f"also {part}" for part in parts[1:]]
        others = self._count_running()
        if others:
            parts.append(f"stopping the other {_plural(others)}")
        self._say("; ".join(parts))

    def _note_stop_signal(self) -> None:
        self._stop_signal = self._signals[0]
        running = self._count_running()
        tail = f"; stopping {_plural(running)}" if running else ""
        self._say(f"received {_signal_name(self._stop_signal)}{tail}")

    def _count_running(self) -> int:
        return sum(1 for child in self._children if child.popen.poll() is None)

    # -- cleanup -------------------------------------------------------------------------------------------

    def _shutdown(self, out: TextIO) -> None:
        self._start_pump(out)  # in case spawning raised before the pump was started
        self._stop_groups()
        # Final sweep: the groups stopped above are empty, but a group whose leader exited 0 earlier may
        # still hold processes that escaped the check in a race. SIGKILL to an empty group is harmless.
        for child in self._children:
            _signal_group(child.popen.pid, signal.SIGKILL)
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
        alive = [child for child in self._children if _group_alive(child.popen.pid)]
        if not alive:
            return
        for child in alive:
            _signal_group(child.popen.pid, signal.SIGTERM)
        # A signal beyond the one that stopped the job means "hurry up": skip the rest of the grace period.
        signals_seen = 1 if self._stop_signal is not None else 0
        deadline = time.monotonic() + self._grace_s
        while True:
            for child in alive:
                child.popen.poll()  # reap the leader, so that it no longer counts as a member of its group
            alive = [child for child in alive if _group_alive(child.popen.pid)]
            if not alive:
                return
            names = ", ".join(child.spec.name for child in alive)
            if len(self._signals) > signals_seen:
                again = _signal_name(self._signals[-1])
                self._say(f"received {again} again; sending SIGKILL to the processes of {names}")
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                grace = f"{self._grace_s:g} s"
                self._say(f"the processes of {names} did not stop within {grace} of SIGTERM; sending SIGKILL")
                break
            self._wait(min(_GRACE_POLL_S, remaining))
        for child in alive:
            _signal_group(child.popen.pid, signal.SIGKILL)

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
            alive = [child for child in self._children if _group_alive(child.popen.pid)]
            if not alive:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(child.spec.name for child in alive)
                self._say(
                    f"the processes of {names} did not die within {_REAP_TIMEOUT_S:g} s of SIGKILL "
                    "(stuck in the kernel, e.g. on a dead network mount?); giving up on them"
                )
                return
            self._wait(_KILL_POLL_S)

    def _run_on_exit(self) -> None:
        for callback in self._on_exit:
            try:
                callback()
            except Exception:
                name = getattr(callback, "__qualname__", repr(callback))
                self._say(f"on_exit callback {name} failed (continuing):\n{traceback.format_exc().rstrip()}")

    def _outcome(self) -> Outcome:
        if self._stop_signal is not None:
            return Outcome(128 + self._stop_signal, self._failure, _signal_name(self._stop_signal))
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
