"""The one update rule of the parameter server under BSP, SSP and ASP: gradients are applied in *rounds*.

Why a rule of its own. If every push were one optimizer step, N workers would step N times as far per clock
as one synchronous step on their mean gradient, and momentum or Adam state would advance N times per clock:
SSP(0) would not be BSP, and comparing BSP with SSP or ASP would measure the learning rate, not the
consistency model. So in every mode a server applies pushes the way synchronous SGD does — one optimizer step
on the mean of a *round* of pushes — and the modes differ only in what makes a round and in how stale the
parameters were that the gradients were computed on:

* **BSP and SSP(s): a round is a clock.** The pushes every worker made at clock k are summed; when every live
  worker has completed clock k (``min(done) > k``) the server takes one step on their mean. SSP(0) is BSP by
  construction; SSP(s) differs only in that a worker may read (and compute on) parameters up to s rounds old,
  Petuum's guarantee. A server holds at most s + 1 open rounds per chunk.
* **ASP: a round is every N pushes in arrival order,** N the number of live workers (Zhang et al. 2016's
  "1-softsync" protocol): the step is as long as BSP's in expectation, momentum advances once per N
  gradients, and nobody waits. A fast worker may put several pushes in one round — that is asynchrony. When
  workers leave, a round closes at the new N; with one worker every push is a step (plain SGD).

The step of a round is ``optimizer.step(value, sum(w_i * g_i) / count)``; ``w_i = 1``, or, with the
staleness-aware learning rate (off by default; Zhang, Gupta, Lian & Liu, IJCAI 2016), ``w_i = 1 / max(1, τ_i)``
where τ_i is how many rounds separate the version the worker read from the round its gradient lands in
(0 under BSP, up to s under SSP, about 1 under ASP): staler gradients take smaller steps.

What a read sees. Under BSP (and SSP(0)) a pull is answered only when every round it needs is applied,
and it sees exactly those. Under SSP(s > 0) and ASP a pull is answered while rounds are still open; holding
their gradients back would make every read s rounds stale for as long as one worker runs s clocks ahead,
which with momentum costs accuracy (Dai et al. 2015, "eager" SSP: fresher reads converge faster). So such a
read sees a *preview*: the applied value with each open round's step taken on a copy, on the mean of the
gradients it holds so far — the worker's own included (read-my-writes). A preview is never stored: the
optimizer state still advances once per round, and SSP's guarantee (every round < c - s) is unchanged.

A round made only of row pushes (``push_rows``) is a lazy sparse step (only those rows and their state move,
as torch's SparseAdam); a dense push in the round makes it dense. Pushes without an optimizer are added into
the value at once in every mode: addition commutes, so there is nothing to order.

Everything here is pure (no I/O, no clocks of its own): the server calls it, the tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from paratrain.ps.optim import ServerOptimizer

__all__ = ["Mode", "RoundSum", "commit_ready", "mode_of", "preview", "round_of_push", "staleness_weight"]

#: ``"clock"``: rounds are clocks (BSP, SSP); ``"arrival"``: rounds are every N pushes (ASP).
Mode = Literal["clock", "arrival"]
Array = npt.NDArray[Any]


def mode_of(kind: str) -> Mode:
    """The round mode of a consistency kind: clocks for ``"bsp"`` and ``"ssp"``, arrival for ``"asp"``.

    Example:
        >>> mode_of("ssp"), mode_of("asp")
        ('clock', 'arrival')
    """
    if kind in ("bsp", "ssp"):
        return "clock"
    if kind == "asp":
        return "arrival"
    raise ValueError(f"unknown consistency {kind!r}; one of bsp, ssp, asp")


def round_of_push(mode: Mode, push_clock: int, first_open: int) -> int:
    """The round a push joins: its worker's clock under ``"clock"``, the open round under ``"arrival"``.

    ``first_open`` is the oldest round not yet applied (the chunk's version). Under ``"clock"`` a push can name
    an older clock only if it comes from a worker already dropped from the bookkeeping (lost, its messages
    still in flight); it joins the oldest open round rather than reopen one already applied.

    Example:
        >>> round_of_push("clock", 7, 3), round_of_push("clock", 2, 3), round_of_push("arrival", 7, 3)
        (7, 3, 3)
    """
    return max(push_clock, first_open) if mode == "clock" else first_open


def commit_ready(mode: Mode, round_id: int, count: int, min_done: int, live: int) -> bool:
    """Whether round ``round_id`` holding ``count`` pushes is complete and its step may be taken.

    ``"clock"``: when every live worker has completed that clock, ``min_done > round_id`` (the server's
    ``min_done`` never decreases, so rounds complete in order). ``"arrival"``: when it holds as many pushes as
    there are live workers (at least one: with nobody left, a partial round is applied rather than lost).

    Example:
        >>> commit_ready("clock", 2, 1, min_done=2, live=4), commit_ready("clock", 2, 4, min_done=3, live=4)
        (False, True)
        >>> commit_ready("arrival", 0, 3, min_done=0, live=4), commit_ready("arrival", 0, 3, min_done=0, live=3)
        (False, True)
    """
    if mode == "clock":
        return min_done > round_id
    return count >= max(1, live)


def staleness_weight(round_id: int, read_version: int | None, *, aware: bool) -> float:
    """The weight of one push's gradient in its round: 1, or ``1 / max(1, τ)`` with the staleness-aware rate.

    τ = ``round_id - read_version``: how many rounds the parameters the worker read were behind the round its
    gradient joins. A push that did not say what it read (no pull yet) counts as fresh.

    Example:
        >>> [staleness_weight(10, read, aware=True) for read in (6, 9, None)], staleness_weight(10, 6, aware=False)
        ([0.25, 1.0, 1.0], 1.0)
    """
    if not aware or read_version is None:
        return 1.0
    return 1.0 / max(1, round_id - read_version)


@dataclass
class RoundSum:
    """The open sum of one round's gradients on one chunk: dense, or row pushes kept as they came.

    ``add`` the pushes (with their weights), then :meth:`apply` takes the round's one step. Memory: one array
    of the chunk's shape once any push is dense; the pushed rows only while all are sparse.
    """

    count: int = 0
    dense: Array | None = None
    rows: list[npt.NDArray[np.int64]] = field(default_factory=list)
    parts: list[Array] = field(default_factory=list)

    def add(
        self, grad: Array, rows: npt.NDArray[np.int64] | None, weight: float, like: Array, *, densify: bool = False
    ) -> None:
        """Adds one push: ``grad`` for the whole chunk, or for ``rows`` of it (``like`` is the chunk's value).

        ``densify``: the rows are a sparse encoding of a dense gradient (top-k compression), zero elsewhere: the
        round is dense (every element and its optimizer state steps), not a lazy sparse one."""
        self.count += 1
        if rows is not None and self.dense is None and not densify:
            scaled = np.array(grad, dtype=like.dtype, copy=True)
            if weight != 1.0:
                scaled *= like.dtype.type(weight)
            self.rows.append(rows.copy())
            self.parts.append(scaled)
            return
        if self.dense is None:
            self.dense = np.zeros_like(like)
            for r, p in zip(self.rows, self.parts, strict=True):
                np.add.at(self.dense, r, p)
            self.rows.clear()
            self.parts.clear()
        term = np.asarray(grad, dtype=like.dtype)
        if weight != 1.0:
            term = term * like.dtype.type(weight)
        if rows is None:
            np.add(self.dense, term, out=self.dense)
        else:
            np.add.at(self.dense, rows, term)

    def apply(self, optimizer: ServerOptimizer, value: Array, state: dict[str, Array], *, keep: bool = False) -> None:
        """Takes the round's one step on the mean gradient, ``sum / count``, in place on ``value`` and ``state``.

        ``keep=True`` leaves this sum as it was (for a preview, on copies of ``value`` and ``state``); otherwise
        the sum's buffer is reused for the mean.
        """
        if self.count == 0:
            return
        if self.dense is not None:
            if keep:
                optimizer.step(value, self.dense / self.count, state)
            else:
                np.divide(self.dense, self.count, out=self.dense)
                optimizer.step(value, self.dense, state)
            return
        rows = np.concatenate(self.rows)
        grads = np.concatenate(self.parts) / value.dtype.type(self.count)
        optimizer.step_rows(value, grads, rows, state)


def preview(
    optimizer: ServerOptimizer, value: Array, state: dict[str, Array], open_rounds: dict[int, RoundSum]
) -> Array:
    """``value`` after every open round's step, oldest first, computed on copies: what an eager read sees.

    Example:
        >>> from paratrain.ps.optim import SGD
        >>> opt, w = SGD(lr=0.5), np.zeros(2)
        >>> r = RoundSum()
        >>> r.add(np.array([1.0, 3.0]), None, 1.0, w)
        >>> preview(opt, w, opt.init_state(w), {0: r}).tolist(), w.tolist()
        ([-0.5, -1.5], [0.0, 0.0])
    """
    out = value.copy()
    scratch = {name: array.copy() for name, array in state.items()}
    for round_id in sorted(open_rounds):
        open_rounds[round_id].apply(optimizer, out, scratch, keep=True)
    return out
