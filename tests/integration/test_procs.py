"""Integration tests of the local process supervisor, with real child processes."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from paratrain.errors import ConfigError
from paratrain.launch.procs import EXIT_TIMED_OUT, Outcome, ProcSpec, Supervisor

REPO_ROOT = Path(__file__).resolve().parents[2]

# Children that block until they are stopped. Sleeping is fine here: these are the processes to be killed.
SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"
IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
)
# Starts a grandchild (in the child's process group, inherited) that ignores SIGTERM and keeps the child's
# stderr pipe open, waits until the grandchild ignores SIGTERM, reports its pid, then exits 0.
GRANDPARENT = (
    "import subprocess, sys; "
    "g = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
    "time.sleep(60)'], stdout=subprocess.PIPE); "
    "g.stdout.readline(); "
    "print('grandchild', g.pid, flush=True)"
)


def spec(index: int, code: str) -> ProcSpec:
    """A Python child named ``rank <index>`` whose lines are prefixed ``[rank<index>]: ``."""
    return ProcSpec(
        name=f"rank {index}",
        argv=[sys.executable, "-c", code],
        env=dict(os.environ),
        prefix=f"[rank{index}]: ",
    )


def alive(pid: int) -> bool:
    """True if ``pid`` is a running process (a zombie is dead: here PID 1 may never reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(b")")[2].split()[0] not in (b"Z", b"X")


class WatchedStream(io.StringIO):
    """A text stream the test can wait on, so it synchronises on the supervisor's output, not on time."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()

    def write(self, s: str) -> int:
        with self._cond:
            written = super().write(s)
            self._cond.notify_all()
        return written

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 10.0) -> str:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.getvalue()), timeout):
                raise AssertionError(f"timed out waiting for output; so far: {self.getvalue()!r}")
            return self.getvalue()


class Background:
    """Runs ``Supervisor.run()`` on a thread (so no signal handlers are installed) and keeps the result."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcome = self.supervisor.run()
        except BaseException as exc:
            self.error = exc

    def join(self, timeout: float = 10.0) -> Outcome:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "Supervisor.run() did not return"
        assert self.error is None, self.error
        assert self.outcome is not None
        return self.outcome


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    """Safety net: whatever a test asserts, SIGKILL every process group its supervisors started."""
    created: list[Supervisor] = []
    yield created
    for supervisor in created:
        for pid in supervisor.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def make(supervisors: list[Supervisor], specs: list[ProcSpec], **kwargs: Any) -> Supervisor:
    supervisor = Supervisor(specs, **kwargs)
    supervisors.append(supervisor)
    return supervisor


def count(text: str, needle: str) -> int:
    return text.count(needle)


@pytest.mark.timeout(30)
def test_all_children_succeed_and_output_is_prefixed(supervisors: list[Supervisor]) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = "import sys; i = sys.argv[1]; print('hello', i); print('second', i); print('oops', i, file=sys.stderr)"
    specs = [
        ProcSpec(f"rank {i}", [sys.executable, "-c", code, str(i)], dict(os.environ), f"[rank{i}]: ") for i in range(3)
    ]
    handlers_before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)]

    outcome = make(supervisors, specs, stdout=out, stderr=err).run()

    assert outcome == Outcome(exit_code=0, first_failure=None, interrupted_by=None)
    lines = out.getvalue().splitlines()
    for i in range(3):
        # Each child's own lines stay in order, whole, and carry its prefix.
        mine = [line for line in lines if line.startswith(f"[rank{i}]: ")]
        assert mine == [f"[rank{i}]: hello {i}", f"[rank{i}]: second {i}"]
        assert f"[rank{i}]: oops {i}\n" in err.getvalue()
    assert len(lines) == 6
    assert "paratrain launch" not in err.getvalue()
    # run() ran on the main thread, so it installed handlers; they must be back as they were.
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)] == handlers_before
    supervisor = supervisors[0]
    assert len(supervisor.pids()) == 3
    assert not any(alive(pid) for pid in supervisor.pids())


@pytest.mark.timeout(30)
def test_partial_last_line_and_bad_bytes_are_relayed(supervisors: list[Supervisor]) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = "import sys; sys.stdout.write('first\\nno newline at the end'); sys.stderr.buffer.write(b'bad \\xff byte')"
    outcome = make(supervisors, [spec(0, code)], stdout=out, stderr=err).run()

    assert outcome.exit_code == 0
    assert out.getvalue() == "[rank0]: first\n[rank0]: no newline at the end\n"
    assert err.getvalue() == "[rank0]: bad \ufffd byte\n"


@pytest.mark.timeout(30)
def test_empty_prefix_leaves_lines_unchanged(supervisors: list[Supervisor]) -> None:
    out = io.StringIO()
    child = ProcSpec("solo", [sys.executable, "-c", "print('plain')"], dict(os.environ), "")
    assert make(supervisors, [child], stdout=out, stderr=io.StringIO()).run().exit_code == 0
    assert out.getvalue() == "plain\n"


@pytest.mark.timeout(30)
def test_nonzero_exit_stops_the_others_quickly(supervisors: list[Supervisor]) -> None:
    out, err = io.StringIO(), io.StringIO()
    specs = [spec(0, "import sys; sys.exit(3)"), spec(1, SLEEPER), spec(2, SLEEPER)]
    supervisor = make(supervisors, specs, grace_s=3.0, stdout=out, stderr=err)

    started = time.monotonic()
    outcome = supervisor.run()
    elapsed = time.monotonic() - started

    assert outcome.exit_code == 1
    assert outcome.interrupted_by is None
    failure = outcome.first_failure
    assert failure is not None
    assert (failure.name, failure.returncode, failure.cause) == ("rank 0", 3, "exited with code 3")
    assert failure.pid == supervisor.pids()[0]
    assert (
        f"paratrain launch: rank 0 (pid {failure.pid}) exited with code 3; stopping the other 2 processes\n"
        in err.getvalue()
    )
    assert not any(alive(pid) for pid in supervisor.pids())
    # The sleepers die on SIGTERM, so the grace period must not be waited out.
    assert elapsed < 2.5, elapsed


@pytest.mark.timeout(30)
def test_child_killed_by_signal_is_reported_and_others_stopped(supervisors: list[Supervisor]) -> None:
    out, err = WatchedStream(), io.StringIO()
    supervisor = make(supervisors, [spec(i, SLEEPER) for i in range(3)], stdout=out, stderr=err)
    running = Background(supervisor)
    out.wait_for(lambda text: count(text, "ready") == 3)

    victim = supervisor.pids()[1]
    os.kill(victim, signal.SIGKILL)
    outcome = running.join()

    assert outcome.exit_code == 1
    failure = outcome.first_failure
    assert failure is not None
    assert (failure.name, failure.pid, failure.returncode) == ("rank 1", victim, -signal.SIGKILL)
    assert failure.cause == "was killed by signal SIGKILL"
    assert f"rank 1 (pid {victim}) was killed by signal SIGKILL; stopping the other 2 processes" in err.getvalue()
    assert not any(alive(pid) for pid in supervisor.pids())


@pytest.mark.timeout(30)
def test_failures_at_about_the_same_time_are_all_reported(supervisors: list[Supervisor]) -> None:
    # Peers of a failed rank often fail because of it, a moment later or even a moment earlier; the
    # supervisor must report their own exit status rather than overwrite it by stopping them.
    out, err = WatchedStream(), io.StringIO()
    supervisor = make(supervisors, [spec(i, SLEEPER) for i in range(3)], stdout=out, stderr=err)
    running = Background(supervisor)
    out.wait_for(lambda text: count(text, "ready") == 3)

    first, second, survivor = supervisor.pids()[2], supervisor.pids()[0], supervisor.pids()[1]
    os.kill(first, signal.SIGKILL)
    os.kill(second, signal.SIGKILL)
    outcome = running.join()

    assert outcome.exit_code == 1
    assert outcome.first_failure is not None and outcome.first_failure.pid in (first, second)
    lines = [line for line in err.getvalue().splitlines() if line.startswith("paratrain launch: ")]
    assert len(lines) == 1, lines
    assert f"rank 2 (pid {first}) was killed by signal SIGKILL" in lines[0]
    assert f"rank 0 (pid {second}) was killed by signal SIGKILL" in lines[0]
    assert "; also rank " in lines[0]
    assert lines[0].endswith("; stopping the other 1 process")
    assert not alive(survivor)


@pytest.mark.timeout(30)
def test_child_ignoring_sigterm_is_killed_after_grace(supervisors: list[Supervisor]) -> None:
    out, err = WatchedStream(), io.StringIO()
    supervisor = make(supervisors, [spec(0, IGNORES_SIGTERM), spec(1, SLEEPER)], grace_s=0.5, stdout=out, stderr=err)
    running = Background(supervisor)
    out.wait_for(lambda text: count(text, "ready") == 2)

    started = time.monotonic()
    os.kill(supervisor.pids()[1], signal.SIGKILL)
    outcome = running.join()
    elapsed = time.monotonic() - started

    assert outcome.exit_code == 1
    assert outcome.first_failure is not None and outcome.first_failure.name == "rank 1"
    assert "the processes of rank 0 did not stop within 0.5 s of SIGTERM; sending SIGKILL" in err.getvalue()
    assert not any(alive(pid) for pid in supervisor.pids())
    assert 0.5 <= elapsed < 2.5, elapsed


@pytest.mark.timeout(30)
def test_grandchild_does_not_survive(supervisors: list[Supervisor]) -> None:
    # The child exits 0 right away, leaving a grandchild that ignores SIGTERM and holds the child's stdout
    # open: run() must still kill it, and must not hang waiting for the end of that output.
    out, err = io.StringIO(), io.StringIO()
    supervisor = make(supervisors, [spec(0, GRANDPARENT)], grace_s=0.5, stdout=out, stderr=err)

    started = time.monotonic()
    outcome = supervisor.run()
    elapsed = time.monotonic() - started

    assert outcome.exit_code == 0
    assert "the processes of rank 0 did not stop within 0.5 s of SIGTERM; sending SIGKILL" in err.getvalue()
    assert elapsed >= 0.5
    words = out.getvalue().split()
    assert words[:2] == ["[rank0]:", "grandchild"], out.getvalue()
    grandchild = int(words[2])
    assert not alive(grandchild)
    assert not any(alive(pid) for pid in supervisor.pids())


@pytest.mark.timeout(30)
def test_grandchild_of_a_stopped_child_does_not_survive(supervisors: list[Supervisor]) -> None:
    out, err = WatchedStream(), io.StringIO()
    code = GRANDPARENT + "; import time; time.sleep(60)"
    supervisor = make(supervisors, [spec(0, code), spec(1, SLEEPER)], grace_s=0.5, stdout=out, stderr=err)
    running = Background(supervisor)
    text = out.wait_for(lambda text: "grandchild" in text and "ready" in text)
    grandchild = int(text.split("grandchild ")[1].split()[0])

    os.kill(supervisor.pids()[1], signal.SIGKILL)
    outcome = running.join()

    assert outcome.exit_code == 1
    assert "the processes of rank 0 did not stop within 0.5 s of SIGTERM; sending SIGKILL" in err.getvalue()
    assert not alive(grandchild)
    assert not any(alive(pid) for pid in supervisor.pids())


@pytest.mark.timeout(30)
def test_command_not_found_stops_the_started_ones(supervisors: list[Supervisor]) -> None:
    out, err = io.StringIO(), io.StringIO()
    missing = ProcSpec("rank 1", ["/nonexistent/paratrain-no-such-command"], dict(os.environ), "[rank1]: ")
    supervisor = make(supervisors, [spec(0, SLEEPER), missing, spec(2, SLEEPER)], stdout=out, stderr=err)

    outcome = supervisor.run()

    assert outcome.exit_code == 1
    failure = outcome.first_failure
    assert failure is not None
    assert (failure.name, failure.pid, failure.returncode) == ("rank 1", 0, 127)
    assert failure.cause.startswith("could not be started: No such file or directory")
    assert "/nonexistent/paratrain-no-such-command" in failure.cause
    assert f"paratrain launch: rank 1 {failure.cause}; stopping the other 1 process\n" in err.getvalue()
    # Rank 2 is never started once rank 1 failed; rank 0 was started and is stopped.
    assert len(supervisor.pids()) == 1
    assert not alive(supervisor.pids()[0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exit_code", [0, 5])
def test_on_exit_callbacks_run_once_even_when_one_raises(supervisors: list[Supervisor], exit_code: int) -> None:
    calls: list[str] = []

    def first() -> None:
        calls.append("first")

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("cleanup went wrong")

    def last() -> None:
        # Callbacks run after every child is gone, so they may safely remove what the children used.
        assert not any(alive(pid) for pid in supervisors[0].pids())
        calls.append("last")

    err = io.StringIO()
    specs = [spec(0, f"import sys; sys.exit({exit_code})"), spec(1, SLEEPER if exit_code else "pass")]
    supervisor = make(supervisors, specs, stdout=io.StringIO(), stderr=err, on_exit=[first, broken, last])

    outcome = supervisor.run()

    assert outcome.exit_code == (1 if exit_code else 0)
    assert calls == ["first", "broken", "last"]
    assert "on_exit callback" in err.getvalue()
    assert "RuntimeError: cleanup went wrong" in err.getvalue()


@pytest.mark.timeout(30)
def test_run_twice_and_bad_arguments_are_refused(supervisors: list[Supervisor]) -> None:
    supervisor = make(supervisors, [spec(0, "pass")], stdout=io.StringIO(), stderr=io.StringIO())
    assert supervisor.run().exit_code == 0
    with pytest.raises(RuntimeError, match="only once"):
        supervisor.run()
    with pytest.raises(ConfigError):
        Supervisor([])
    with pytest.raises(ConfigError):
        Supervisor([spec(0, "pass")], grace_s=-1)
    with pytest.raises(ConfigError):
        Supervisor([ProcSpec("rank 0", [], {}, "")])
    with pytest.raises(ConfigError):
        Supervisor([spec(0, "pass")], deadline_s=0)


@pytest.mark.timeout(30)
def test_a_job_past_its_deadline_is_stopped_even_a_child_ignoring_sigterm(supervisors: list[Supervisor]) -> None:
    # The story: benchmarks guarded their jobs with a timer that walked /proc and SIGKILLed their own children,
    # because a PS server loop could hang after its workers exited and the supervisor waited for it for ever.
    out, err = WatchedStream(), io.StringIO()
    specs = [spec(0, IGNORES_SIGTERM), spec(1, SLEEPER)]
    supervisor = make(supervisors, specs, grace_s=0.3, deadline_s=4.0, stdout=out, stderr=err)
    started = time.monotonic()
    running = Background(supervisor)
    out.wait_for(lambda text: count(text, "ready") == 2)  # both children are up (rank 0 ignores SIGTERM now)
    outcome = running.join(timeout=15)
    elapsed = time.monotonic() - started

    assert outcome.timed_out and outcome.exit_code == EXIT_TIMED_OUT == 124
    assert outcome.first_failure is None and outcome.interrupted_by is None
    messages = err.getvalue()
    assert "still running after the job's deadline of 4 s; stopping 2 processes" in messages
    assert "the processes of rank 0 did not stop within 0.3 s of SIGTERM; sending SIGKILL" in messages
    assert not any(alive(pid) for pid in supervisor.pids())
    assert 4.0 <= elapsed < 10, elapsed


@pytest.mark.timeout(30)
def test_a_job_within_its_deadline_ends_as_usual(supervisors: list[Supervisor]) -> None:
    supervisor = make(supervisors, [spec(0, "pass")], deadline_s=20, stdout=io.StringIO(), stderr=io.StringIO())
    outcome = supervisor.run()
    assert outcome == Outcome(0, None, None) and not outcome.timed_out


# A supervisor in a process of its own, so that it runs on its main thread and owns its signal handlers.
# argv: grace_s, then one child program per child.
SUPERVISOR_SCRIPT = """
import os, sys
from paratrain.launch.procs import ProcSpec, Supervisor

grace_s = float(sys.argv[1])
specs = [
    ProcSpec(f"rank {i}", [sys.executable, "-c", code], dict(os.environ), f"[rank{i}]: ")
    for i, code in enumerate(sys.argv[2:])
]
outcome = Supervisor(specs, grace_s=grace_s).run()
summary = ("outcome", outcome.exit_code, outcome.interrupted_by, outcome.first_failure)
print(*summary, file=sys.stderr, flush=True)
sys.exit(outcome.exit_code)
"""

# Reports its pid, so that the test can check that it is gone afterwards.
REPORTS_PID = "import os, time; print('ready', os.getpid(), flush=True); time.sleep(60)"
REPORTS_PID_IGNORES_SIGTERM = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', os.getpid(), flush=True); time.sleep(60)"
)


@contextlib.contextmanager
def supervisor_process(grace_s: float, *children: str) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """Starts the supervisor script and waits until every child has printed its ready line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR_SCRIPT, str(grace_s), *children],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        while len(pids) < len(children):
            line = proc.stdout.readline()
            assert line, f"supervisor ended early: {proc.communicate()}"
            words = line.split()
            if words[1:2] == ["ready"]:
                pids.append(int(words[2]))
        yield proc, pids
    finally:
        if proc.poll() is None:
            proc.kill()  # its children then die of PR_SET_PDEATHSIG
        proc.communicate()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stop_signal_to_the_supervisor_stops_the_children(signum: signal.Signals, expected: int) -> None:
    with supervisor_process(3.0, REPORTS_PID, REPORTS_PID) as (proc, pids):
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=10)

        assert proc.returncode == expected, err
        assert f"paratrain launch: received {signum.name}; stopping 2 processes\n" in err
        assert f"outcome {expected} {signum.name} None\n" in err
        assert not any(alive(pid) for pid in pids)


@pytest.mark.timeout(30)
def test_second_sigint_skips_the_grace_period() -> None:
    with supervisor_process(60.0, REPORTS_PID_IGNORES_SIGTERM) as (proc, pids):
        assert proc.stderr is not None
        proc.send_signal(signal.SIGINT)
        assert proc.stderr.readline() == "paratrain launch: received SIGINT; stopping 1 process\n"
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)

        assert proc.returncode == 130, err
        assert "received SIGINT again; sending SIGKILL to the processes of rank 0" in err
        assert time.monotonic() - started < 5
        assert not any(alive(pid) for pid in pids)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkill_to_the_supervisor_takes_the_children_along() -> None:
    with supervisor_process(3.0, REPORTS_PID, REPORTS_PID) as (proc, pids):
        proc.kill()
        proc.wait(timeout=10)
        # PR_SET_PDEATHSIG delivers SIGKILL to the children as the supervisor dies; allow it a moment.
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(alive(pid) for pid in pids)
