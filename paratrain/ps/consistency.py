"""BSP, SSP(s) and ASP as pure rules over worker clocks (Petuum's stale synchronous parallel, Bösen). No I/O.

Clocks. A worker's clock is the number of times it has called ``kv.clock()``, starting at 0; pushes it makes
while at clock k are *pushes at clock k*. A worker's pushes and clock messages travel in order on one channel,
so when a server has received ``done[w]`` clock messages from worker w, it has applied every push w made at
clocks ``< done[w]``: w has *completed* those clocks::

    worker w   push push clock() push clock() push push ...
               |-- clock 0 --|   |- clock 1 -|  clock 2
    server     done[w] = 2  =>  every push of w at clocks 0 and 1 is applied

The guarantee (Ho et al., NIPS'13). Under SSP with staleness s, a read by a worker at clock c sees every push
made at clocks ``< c - s`` by every worker, that is ``min(done) >= c - s`` over the live workers; it may see
newer pushes too, and the runtime lets a worker see its own (read-my-writes). BSP is SSP with s = 0: at clock c
a worker sees everything pushed before clock c, as if all workers met at a barrier. ASP promises nothing:
reads are answered at once with whatever the server holds.

The server holds back a pull until :meth:`Policy.pull_ready`; the worker blocks in ``clock()`` until
:meth:`Policy.may_run` (the fastest worker is at most s clocks ahead of the slowest); the worker's cache
answers a pull itself while :meth:`Policy.cache_fresh`. The three are the same inequality, seen from three
places, so they can never disagree.

Choosing s: s = 0 (BSP) waits for the slowest worker every clock; a small s (2-3 in Petuum's experiments)
hides stragglers and jitter at little cost in convergence per step; a large s approaches ASP, whose updates can
be arbitrarily stale and which needs a smaller learning rate to stay stable.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from paratrain.errors import ConfigError

__all__ = ["Kind", "Policy", "min_done", "required_met"]

Kind = Literal["bsp", "ssp", "asp"]
_KINDS: tuple[str, ...] = get_args(Kind)


def _check_clock(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A consistency model: when a pull may be answered and how far ahead a worker may run.

    Build one with :meth:`parse` from the user's settings; the constructor takes the normalised form and checks
    it. ``staleness`` is 0 for BSP, s >= 0 for SSP, and -1 for ASP, meaning *no bound* (never a number of
    clocks: ASP's rules never read it, and -1 would block forever if code used it as one).

    Example:
        >>> policy = Policy.parse("ssp", staleness=2)
        >>> policy.pull_ready(5, {0: 3, 1: 2})  # needs min(done) >= 5 - 2 = 3
        False
        >>> policy.pull_ready(5, {0: 3, 1: 3})
        True
    """

    kind: Kind
    staleness: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"unknown consistency {self.kind!r}; choose one of {', '.join(_KINDS)}")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int):
            raise ConfigError(f"staleness must be an int, got {self.staleness!r}")
        if self.kind == "bsp" and self.staleness != 0:
            raise ConfigError(f"bsp has staleness 0, got {self.staleness}; for a bound s use consistency='ssp'")
        if self.kind == "ssp" and self.staleness < 0:
            raise ConfigError(f"ssp needs staleness >= 0, got {self.staleness}")
        if self.kind == "asp" and self.staleness != -1:
            raise ConfigError(f"asp has no staleness bound and stores staleness=-1, got {self.staleness}")

    @classmethod
    def parse(cls, consistency: str, staleness: int | None = None) -> Policy:
        """The policy for a user's ``consistency=`` and ``staleness=`` settings (case-insensitive kind).

        ``"ssp"`` needs a staleness; ``"ssp"`` with 0 is allowed and follows BSP's rules exactly (tests use it
        to check that SSP degrades to BSP). ``"bsp"`` accepts only ``None`` or 0. ``"asp"`` ignores a
        staleness, with a warning, since it has no bound.

        Raises:
            ConfigError: an unknown kind, or a staleness that does not fit it.

        Example:
            >>> Policy.parse("BSP")
            Policy(kind='bsp', staleness=0)
            >>> Policy.parse("asp")
            Policy(kind='asp', staleness=-1)
        """
        if not isinstance(consistency, str):
            raise ConfigError(f"consistency must be a str, one of {', '.join(_KINDS)}; got {consistency!r}")
        kind = consistency.strip().lower()
        if kind not in _KINDS:
            raise ConfigError(f"unknown consistency {consistency!r}; choose one of {', '.join(_KINDS)}")
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int)):
            raise ConfigError(f"staleness must be an int, got {staleness!r}")
        if kind == "bsp":
            if staleness not in (None, 0):
                raise ConfigError(
                    f"bsp waits for every worker each clock, so staleness must be None or 0, got {staleness}; "
                    f"for a bound s use consistency='ssp', staleness=s"
                )
            return cls(kind="bsp", staleness=0)
        if kind == "ssp":
            if staleness is None:
                raise ConfigError("ssp needs a staleness bound: pass staleness=s with s >= 0 (s=0 is BSP)")
            if staleness < 0:
                raise ConfigError(f"ssp needs staleness >= 0, got {staleness}")
            return cls(kind="ssp", staleness=staleness)
        if staleness is not None:
            warnings.warn(
                f"staleness={staleness} is ignored: asp has no staleness bound; use consistency='ssp' for one",
                UserWarning,
                stacklevel=2,
            )
        return cls(kind="asp", staleness=-1)

    @property
    def clocked(self) -> bool:
        """Whether reads wait on the workers' clocks (BSP, SSP); ASP's never do.

        Example:
            >>> Policy.parse("ssp", 2).clocked, Policy.parse("asp").clocked
            (True, False)
        """
        return self.kind != "asp"

    def required_done(self, pull_clock: int) -> int | None:
        """What ``min(done)`` over the live workers must reach before a pull at ``pull_clock`` is answered.

        ``max(0, c - s)``, so a server can queue the pull under this number and answer it when the slowest
        worker's clock message brings ``min(done)`` there; ``None`` for ASP (answer at once).

        Example:
            >>> Policy.parse("ssp", 1).required_done(4), Policy.parse("ssp", 1).required_done(0)
            (3, 0)
        """
        _check_clock("pull_clock", pull_clock)
        if self.kind == "asp":
            return None
        return max(0, pull_clock - self.staleness)

    def pull_ready(self, pull_clock: int, done: Mapping[int, int]) -> bool:
        """Whether a pull by a worker at ``pull_clock`` may be answered now.

        True when every push at clocks ``< c - s`` is applied: ``min(done) >= c - s``. ``done`` maps each
        *live* worker to the number of clock messages received from it; leave dead workers out, or the pull
        waits for them forever. No live workers: True. ASP: always True.

        Example:
            >>> Policy.parse("bsp").pull_ready(1, {0: 1, 1: 0})  # worker 1 has not finished clock 0
            False
        """
        return required_met(self.required_done(pull_clock), min(done.values()) if done else None)

    def may_run(self, clock: int, min_done: int | None) -> bool:
        """Whether a worker may run at ``clock`` (after its clock() call) given the slowest live worker's done.

        The SSP bound: at most s clocks ahead of the slowest, ``clock - min_done <= s``, the same inequality
        as :meth:`pull_ready`, so a worker allowed to run can also read. ``min_done=None`` (no live workers)
        and ASP: True.

        Example:
            >>> ssp2 = Policy.parse("ssp", 2)
            >>> ssp2.may_run(5, 3), ssp2.may_run(6, 3)
            (True, False)
        """
        _check_clock("clock", clock)
        if self.kind == "asp" or min_done is None:
            return True
        return clock - min_done <= self.staleness

    def cache_fresh(self, cached_done: int, pull_clock: int) -> bool:
        """Whether a cached copy may answer a pull at ``pull_clock`` without asking the server.

        A copy the server sent when its ``min(done)`` was ``cached_done`` (it sends that number with the data)
        reflects every push at clocks ``< cached_done``, so it may serve a pull at clock c iff
        ``cached_done >= c - s``: Bösen's worker-side cache. Keep one ``cached_done`` per chunk, since each
        server has its own. ASP: never, because with no staleness bound a cached copy could serve forever and
        the worker would never see the others' updates; under ASP every pull goes to the server.

        Example:
            >>> ssp1 = Policy.parse("ssp", 1)
            >>> ssp1.cache_fresh(3, 4), ssp1.cache_fresh(3, 5)
            (True, False)
        """
        _check_clock("cached_done", cached_done)
        required = self.required_done(pull_clock)
        return required is not None and cached_done >= required


def min_done(done: Mapping[int, int], live: Iterable[int]) -> int | None:
    """The fewest clocks any live worker has completed: what :meth:`Policy.may_run` compares against.

    A live worker missing from ``done`` has sent no clock message yet and counts as 0. ``None`` when there are
    no live workers.

    Example:
        >>> min_done({0: 3, 1: 5, 2: 1}, live=[0, 1]), min_done({0: 3}, live=[0, 1]), min_done({}, live=[])
        (3, 0, None)
    """
    return min((done.get(w, 0) for w in live), default=None)


def required_met(required: int | None, min_done: int | None) -> bool:
    """Whether a request that needs ``min(done) >= required`` (a pull, or a worker waiting at its clock) may
    be answered: the one comparison the clients ask for and the servers apply. ``required=None`` (ASP) or
    ``min_done=None`` (no live worker left to wait for): at once.

    Example:
        >>> required_met(3, 2), required_met(3, 3), required_met(None, 0), required_met(5, None)
        (False, True, True, True)
    """
    return required is None or min_done is None or min_done >= required
