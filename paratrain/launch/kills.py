"""Kill schedules: which process dies, when, and by which signal, so that every recovery path is a command.

A failure that only happens by chance cannot be tested, and one triggered by hand cannot be repeated. A kill
schedule (``paratrain launch --kill`` and ``paratrain train --kill``) names each failure exactly::

    1@step=5            rank 1 gets SIGKILL as its 5th optimizer step begins (DistributedOptimizer.step, Pipe.step)
    0@step=3:TERM       rank 0 gets SIGTERM there instead
    1@checkpoint=2      rank 1 gets SIGKILL while it takes its 2nd in-memory checkpoint (paratrain.recovery):
                        the state is copied, not yet kept
    1@2.5s              rank 1 gets SIGKILL 2.5 s after the job started (sent by the launcher)
    server0@1s:KILL     parameter server 0, 1 s after the start (servers have no steps: time only)
    random@step=2-40    a worker and a step drawn from the seed (``--kill-seed``), the same on every run

Several kills are separated by commas. A step kill is carried out by the rank itself (the launcher tells it through
``PARATRAIN_KILL``, and :func:`kill_point` fires when the step is reached): only the rank knows its steps, and a
signal it sends itself arrives at exactly that point, not a little before or after. A time kill is sent by the
launcher. Parsing is pure; everything that could go wrong with a schedule (a rank out of range, two step kills of
one rank, an unknown signal) is refused before anything starts.
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import sys
from dataclasses import dataclass

from paratrain.errors import ConfigError

__all__ = ["ENV", "HELP", "Kill", "checkpoint_kill_point", "kill_env", "kill_point", "parse_kills", "time_kill"]

#: The environment variable that tells a rank its step kill: ``STEP:SIGNUM:TEXT`` (a checkpoint kill: ``cV:...``).
ENV = "PARATRAIN_KILL"

HELP = (
    "kill schedule, comma-separated: RANK@step=K (SIGKILL as rank RANK's K-th optimizer step begins), "
    "RANK@checkpoint=V (while it takes its V-th in-memory checkpoint, with --max-restarts), RANK@2.5s (2.5 s after "
    "the start), serverS@1s, random@step=A-B (a worker and step drawn from --kill-seed); add :TERM, :INT... for "
    "another signal"
)

_ITEM = re.compile(
    r"^(?P<who>random|server\d+|\d+)@(?:step=(?P<step>\d+)(?:-(?P<last>\d+))?|checkpoint=(?P<ckpt>\d+)"
    r"|(?P<secs>\d+(?:\.\d+)?)s)"
    r"(?::(?P<sig>[A-Za-z0-9]+))?$"
)


@dataclass(frozen=True, slots=True)
class Kill:
    """One scheduled failure.

    Attributes:
        role: ``"rank"`` (a worker) or ``"server"``.
        index: the worker's rank or the server's index.
        step: the optimizer step (1-based) as which the rank kills itself, or None for a time kill.
        after_s: seconds after the job's start at which the launcher sends the signal, or None for a step kill.
        signum: the signal.
        text: the schedule item it came from, for messages.
        checkpoint: the in-memory checkpoint (1-based) during which the rank kills itself, or None.
    """

    role: str
    index: int
    step: int | None
    after_s: float | None
    signum: int
    text: str
    checkpoint: int | None = None

    @property
    def name(self) -> str:
        """The process's name in the launcher's messages, e.g. ``"rank 1"``."""
        return f"{self.role} {self.index}"

    def describe(self) -> str:
        """E.g. ``"SIGKILL to rank 1 at step 5 (--kill 1@step=5)"``."""
        if self.checkpoint is not None:
            when = f"during checkpoint {self.checkpoint}"
        elif self.step is not None:
            when = f"at step {self.step}"
        else:
            when = f"{self.after_s:g} s after the start"
        return f"{signal.Signals(self.signum).name} to {self.name} {when} (--kill {self.text})"


def _signum(name: str | None, item: str) -> int:
    if name is None:
        return int(signal.SIGKILL)
    upper = name.upper()
    if upper.isdigit():
        number = int(upper)
        if number in {int(s) for s in signal.Signals}:
            return number
    else:
        wanted = upper if upper.startswith("SIG") else f"SIG{upper}"
        if wanted in signal.Signals.__members__:
            return int(signal.Signals[wanted])
    raise ConfigError(f"--kill {item}: unknown signal {name!r}; use e.g. KILL, TERM, INT, SEGV or a number")


def parse_kills(text: str, *, nproc: int, servers: int = 0, seed: int = 0) -> list[Kill]:
    """The kills of a schedule (see the module's docstring for the forms), checked against the job's size.

    ``random@step=A-B`` draws the worker uniformly from the workers no earlier item kills, and the step uniformly
    from A..B, from a generator seeded by ``seed`` and the item's position, so a schedule means the same kills on
    every run.

    Raises:
        ConfigError: a malformed item, a rank or server that the job does not have, a step kill of a server, a
            step below 1, an empty step range, two kills of one process, or an unknown signal.

    Example:
        >>> for kill in parse_kills("1@step=5,0@2.5s:TERM", nproc=2):
        ...     print(kill.describe())
        SIGKILL to rank 1 at step 5 (--kill 1@step=5)
        SIGTERM to rank 0 2.5 s after the start (--kill 0@2.5s:TERM)
    """
    kills: list[Kill] = []
    for position, item in enumerate(p.strip() for p in text.split(",")):
        if not item:
            continue
        match = _ITEM.match(item)
        if match is None:
            raise ConfigError(
                f"--kill {item!r}: write RANK@step=K, RANK@checkpoint=V, RANK@2.5s, serverS@1s or random@step=A-B, "
                "optionally :SIGNAL"
            )
        who, signum = match["who"], _signum(match["sig"], item)
        step = int(match["step"]) if match["step"] is not None else None
        last = int(match["last"]) if match["last"] is not None else step
        after_s = float(match["secs"]) if match["secs"] is not None else None
        ckpt = int(match["ckpt"]) if match["ckpt"] is not None else None
        if ckpt is not None and (ckpt < 1 or who == "random" or who.startswith("server")):
            raise ConfigError(f"--kill {item}: checkpoint kills are of a worker rank, counted from 1")
        if step is not None and last is not None and (step < 1 or last < step):
            raise ConfigError(f"--kill {item}: steps count from 1, and a range A-B needs A <= B")
        if who == "random":
            if step is None or last is None:
                raise ConfigError(f"--kill {item}: random kills are of steps: random@step=A-B")
            draw = random.Random(f"{seed}:{position}")
            free = [r for r in range(nproc) if all((k.role, k.index) != ("rank", r) for k in kills)]
            if not free:
                raise ConfigError(f"--kill {item}: every worker is already killed by an earlier item")
            role, index, step = "rank", draw.choice(free), draw.randint(step, last)
        elif match["last"] is not None:
            raise ConfigError(f"--kill {item}: a step range is for random@step=A-B; give one step for a rank")
        elif who.startswith("server"):
            role, index = "server", int(who[len("server") :])
            if step is not None:
                raise ConfigError(f"--kill {item}: servers have no steps; give a time, e.g. {who}@1s")
            if index >= servers:
                raise ConfigError(f"--kill {item}: the job has {servers} server(s), numbered from 0")
        else:
            role, index = "rank", int(who)
            if index >= nproc:
                raise ConfigError(f"--kill {item}: the job has {nproc} worker(s), ranks 0..{nproc - 1}")
        kills.append(Kill(role, index, step, after_s, signum, item, ckpt))
    named = [k.name for k in kills]
    twice = sorted({name for name in named if named.count(name) > 1})
    if twice:
        raise ConfigError(f"--kill: {', '.join(twice)} is killed more than once; a process dies only once")
    return kills


def time_kill(kills: list[Kill], role: str, index: int) -> tuple[float, int, str] | None:
    """One process's time kill as the launcher's supervisor takes it: (seconds, signal, description)."""
    for kill in kills:
        if kill.role == role and kill.index == index and kill.after_s is not None:
            return kill.after_s, kill.signum, kill.describe()
    return None


def kill_env(kills: list[Kill], role: str, index: int) -> dict[str, str]:
    """The environment that tells one process its step kill (empty if it has none)."""
    for kill in kills:
        if kill.role == role and kill.index == index and kill.step is not None:
            return {ENV: f"{kill.step}:{kill.signum}:{kill.text}"}
        if kill.role == role and kill.index == index and kill.checkpoint is not None:
            return {ENV: f"c{kill.checkpoint}:{kill.signum}:{kill.text}"}
    return {}


@functools.cache
def _scheduled() -> tuple[str, int, int, str] | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    where, signum, text = raw.split(":", 2)
    if where.startswith("c"):
        return "checkpoint", int(where[1:]), int(signum), text
    return "step", int(where), int(signum), text


def kill_point(step: int) -> None:
    """Called by every optimizer step (``step`` from 1): if this process's kill schedule names this step, it says
    so on stderr and sends itself the signal. Costs one cached lookup otherwise."""
    _fire("step", step)


def checkpoint_kill_point(version: int) -> None:
    """Called by every in-memory checkpoint (``version`` from 1) between copying the state and keeping it."""
    _fire("checkpoint", version)


def _fire(where: str, number: int) -> None:
    scheduled = _scheduled()
    if scheduled is None or scheduled[:2] != (where, number):
        return
    _, _, signum, text = scheduled
    print(
        f"paratrain: injected fault: {signal.Signals(signum).name} at {where} {number} (--kill {text})", file=sys.stderr
    )
    sys.stderr.flush()
    sys.stdout.flush()
    os.kill(os.getpid(), signum)
