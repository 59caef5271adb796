"""The alpha-beta(-gamma) cost of a plan, computed by replaying the plan itself: the one cost model.

Model (Hockney's alpha-beta, plus a compute rate): each rank has one thread that issues its actions in order
and one full-duplex link. A message of ``m`` bytes occupies the sender's outgoing link for ``m * beta``
seconds and arrives ``alpha`` after its last byte left; sends from one rank queue on its link, in issue order.
A reduce, copy or finish of ``m`` bytes keeps the rank's thread busy for ``m * gamma`` seconds. Through shared
memory, a ``wait`` completes ``alpha`` after the last of the other ranks' matching ``signal``. A ``compute``
takes its own ``seconds``. An action
starts when the thread reaches it and its ``deps`` are complete (a receive completes when its message has
arrived; a send when its last byte has arrived, the moment its buffer is free in the model).

What it leaves out, on purpose: incoming-link contention (a rank receiving from several peers at once gets
them at full rate each), the CPU cost of sending, and noise. It reproduces the textbook formulas (ring
``2(N-1)(alpha + n/(N beta))``, binomial tree ``2 ceil(log2 N)(alpha + n beta)``...) from the plans rather than
from a second copy of every schedule, which is the point: add a schedule and its cost comes for free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from paratrain.plan.ir import Plan, PlanError

__all__ = ["Costs", "alpha_beta_time", "simulate"]


@dataclass(frozen=True, slots=True)
class Costs:
    """The replay of a plan.

    Attributes:
        finish: when each rank's last action completed (seconds from the start).
        done: ``done[r][i]``: when rank r's action i completed.
    """

    finish: tuple[float, ...]
    done: tuple[tuple[float, ...], ...]

    @property
    def time(self) -> float:
        """The plan's makespan: when the last rank finished."""
        return max(self.finish, default=0.0)


def simulate(
    plan: Plan,
    *,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    links: Mapping[tuple[int, int], tuple[float, float]] | None = None,
) -> Costs:
    """Replays ``plan`` under the model of the module docstring.

    Args:
        plan: any plan (it is validated first).
        alpha: seconds of latency per message.
        beta: seconds per byte on a link (1 / bandwidth).
        gamma: seconds per byte of reduce/copy/finish.
        links: ``(src, dst)`` -> ``(alpha, beta)`` of a link of its own from src to dst (the fault injector's
            ``links=``): messages on it queue there, not on src's link.

    Raises:
        PlanError: the plan is malformed, or deadlocks (some rank waits for a message never sent before it).

    Example:
        >>> from paratrain.plan.ir import Action
        >>> send = Action("send", peer=1, nbytes=100)
        >>> recv = Action("recv", peer=0, nbytes=100)
        >>> use = Action("copy", nbytes=100, deps=(0,))
        >>> simulate(Plan("p2p", ((send,), (recv, use))), alpha=1.0, beta=0.01, gamma=0.001).time
        2.1
    """
    plan.validate()
    n = plan.world_size
    done: list[list[float | None]] = [[None] * len(actions) for actions in plan.ranks]
    cursor = [0] * n
    thread = [0.0] * n
    link = [0.0] * n
    own: dict[tuple[int, int], float] = {}  # when each own link is free
    # arrival times of the messages sent so far, per (src, dst, tag), in order; receives consume them in order
    arrivals: dict[tuple[int, int, int], list[float]] = {}
    consumed: dict[tuple[int, int, int], int] = {}
    waiting: dict[tuple[int, int], tuple[int, int, int, int]] = {}  # (rank, recv action) -> its message
    signalled: dict[tuple[int, int], float] = {}  # (rank, value) -> when it signalled
    progress = True
    while progress:
        progress = False
        for r in range(n):
            actions = plan.ranks[r]
            while cursor[r] < len(actions):
                i = cursor[r]
                a = actions[i]
                deps = [_resolve(done, arrivals, waiting, r, d) for d in a.deps]
                if a.kind == "wait":
                    others = [signalled.get((q, a.tag)) for q in range(n) if q != r]
                    deps += [None if t is None else t + alpha for t in others]
                if any(t is None for t in deps):
                    break
                start = max([thread[r], *(t for t in deps if t is not None)])
                if a.kind in ("signal", "wait"):
                    if a.kind == "signal":
                        signalled[(r, a.tag)] = start
                    done[r][i] = start
                    thread[r] = start
                elif a.kind == "send":
                    pair = None if links is None else links.get((r, a.peer))
                    if pair is None:
                        begin = max(start, link[r])
                        link[r] = begin + a.nbytes * beta
                        arrival = link[r] + alpha
                    else:
                        free = max(start, own.get((r, a.peer), 0.0)) + a.nbytes * pair[1]
                        own[(r, a.peer)] = free
                        arrival = free + pair[0]
                    arrivals.setdefault((r, a.peer, a.tag), []).append(arrival)
                    done[r][i] = arrival
                    thread[r] = start
                elif a.kind == "recv":
                    key = (a.peer, r, a.tag)
                    k = consumed.get(key, 0)
                    consumed[key] = k + 1
                    waiting[(r, i)] = (a.peer, r, a.tag, k)
                    thread[r] = start
                else:
                    thread[r] = start + (a.seconds if a.kind == "compute" else a.nbytes * gamma)
                    done[r][i] = thread[r]
                cursor[r] += 1
                progress = True
    for r in range(n):
        for i in range(len(plan.ranks[r])):
            if done[r][i] is None:
                done[r][i] = _resolve(done, arrivals, waiting, r, i)
    stuck = [r for r in range(n) if cursor[r] < len(plan.ranks[r]) or any(t is None for t in done[r])]
    if stuck:
        raise PlanError(f"{plan.name}: deadlock: ranks {stuck} wait for messages that are never sent before them")
    finished = [[float(t) for t in row if t is not None] for row in done]
    return Costs(finish=tuple(max(row, default=0.0) for row in finished), done=tuple(tuple(row) for row in finished))


def _resolve(
    done: list[list[float | None]],
    arrivals: dict[tuple[int, int, int], list[float]],
    waiting: dict[tuple[int, int], tuple[int, int, int, int]],
    rank: int,
    index: int,
) -> float | None:
    """When action ``index`` of ``rank`` completes, if known yet (a receive: once its message was sent)."""
    t = done[rank][index]
    if t is not None:
        return t
    key = waiting.get((rank, index))
    if key is None:
        return None
    src, dst, tag, k = key
    sent = arrivals.get((src, dst, tag), [])
    if k < len(sent):
        done[rank][index] = sent[k]
        return sent[k]
    return None


def alpha_beta_time(plan: Plan, *, alpha: float, bandwidth: float, gamma: float = 0.0) -> float:
    """Seconds the plan takes under the model with ``bandwidth`` bytes/s links: :func:`simulate`'s makespan."""
    return simulate(plan, alpha=alpha, beta=1.0 / bandwidth, gamma=gamma).time
