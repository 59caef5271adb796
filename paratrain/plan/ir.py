"""The plan IR: every message (src, dst, bytes, tag) and every compute step of a schedule, with dependencies.

One format for every schedule in paratrain, so that three users read the same object:

* the **runtime** iterates a rank's actions in order (:mod:`paratrain.collectives.execute` for collectives):
  what it sends is what the plan says, nothing else;
* the **cost model** (:mod:`paratrain.plan.cost`) replays the world's actions under an alpha-beta-gamma model;
* the **tests** compare plans with exact tables and, through a recording transport, prove that a run sent
  exactly its plan's messages.

A plan is a tuple of :class:`Action` per rank. Actions are *issued* in order by one thread per rank; an action
starts once the actions named in its ``deps`` are complete:

* ``send``: starts sending ``data`` (a :class:`Slice` of a buffer, several of them as one message's arrays
  (:class:`Parts`), or the frame of an earlier receive) to ``peer``; complete when the buffer may be written
  again. Does not block the issuing thread.
* ``recv``: posts a receive from ``peer``; complete when the message has arrived. Does not block either: the
  first action that depends on it waits.
* ``reduce``: ``out = data (op) other``, elementwise; ``copy``: ``out = data``; ``finish``: turns a sum in
  ``out`` into a mean over ``divide_by`` contributions. These run on the issuing thread.
* ``compute``: model code (a pipeline stage's forward ``"F3"`` or backward ``"B3"``, an optimizer step) that
  takes ``seconds`` on the issuing thread; ``label`` names it.
* ``release``: lets go of what an earlier step kept for a later one that does not run on this rank (``label``
  names the step that does not run: a pipeline stage that learns nothing drops a micro-batch at its ``"B3"``
  instead of running a backward). Takes no time and sends nothing.
* ``signal`` and ``wait``: synchronisation through shared memory, where nothing is sent. ``signal`` publishes
  that this rank's counter reached ``tag`` (never blocks); ``wait`` completes once every other rank of the
  plan has signalled ``tag``. Buffers in shared memory are named like any other (``"slots"``, ``index`` = the
  rank whose slot).

Messages are matched like MPI's: the k-th send from ``s`` to ``d`` with tag ``t`` meets the k-th receive
posted by ``d`` from ``s`` with tag ``t``. Tags are offsets within the tag of the call that runs the plan.
Ranks are those of the group the plan runs on. Sizes are in bytes (``nbytes``) and items (``items``), so the
same plan serves the executor (which needs items) and the cost model (which needs bytes). Pure data: no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

__all__ = [
    "Action",
    "Kind",
    "Message",
    "Operand",
    "Parts",
    "Plan",
    "PlanBuilder",
    "PlanError",
    "Received",
    "Slice",
]

Kind = Literal["send", "recv", "reduce", "copy", "finish", "signal", "wait", "compute", "release"]


class PlanError(ValueError):
    """A plan is malformed: unmatched messages, sizes that differ between sender and receiver, bad deps."""


@dataclass(frozen=True, slots=True)
class Slice:
    """Items ``[start, stop)`` of a buffer the executor binds by name (``"src"``, ``"dst"``, ``"gathered"``).

    ``index`` picks one array of a buffer that is a list of arrays (``"gathered"``: rank ``index``'s
    contribution), and is 0 otherwise.
    """

    buffer: str
    start: int
    stop: int
    index: int = 0

    @property
    def items(self) -> int:
        """Number of items."""
        return self.stop - self.start

    def overlaps(self, other: Slice, *, aliased: bool = False) -> bool:
        """True if both name the same memory; with ``aliased``, ``src`` and ``dst`` are one array."""
        same = self.buffer == other.buffer or (aliased and {self.buffer, other.buffer} <= {"src", "dst"})
        return same and self.index == other.index and self.start < other.stop and other.start < self.stop


@dataclass(frozen=True, slots=True)
class Received:
    """The frame received by action number ``action`` of the same rank's plan (read-only); ``index``: which of
    its arrays, for a message that carries several (:class:`Parts`)."""

    action: int
    index: int = 0


@dataclass(frozen=True, slots=True)
class Parts:
    """Several slices sent as the arrays of one message, in order (a parameter server's batch of chunks: one
    message instead of one per chunk, :mod:`paratrain.ps.protocol`)."""

    parts: tuple[Slice, ...]


Operand = Slice | Received | Parts


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank's plan; see the module docstring for what each kind does.

    Attributes:
        kind: what to do.
        peer: the other rank of a ``send`` or ``recv`` (-1 otherwise).
        tag: message tag offset within the call's tag.
        nbytes: bytes on the wire (send/recv) or bytes computed over (reduce/copy/finish).
        items: items sent, received or computed over.
        data: what a send sends, what a copy copies, the first input of a reduce.
        other: the second input of a reduce.
        out: where a reduce, copy or finish writes.
        divide_by: the divisor of a ``finish``.
        deps: numbers of earlier actions of this rank that must be complete first.
        label: what a ``compute`` runs (``"F3"``), a ``release`` stands for, or a message carries.
        seconds: how long a ``compute`` takes, for the cost model.
        lane: which of the rank's threads issues it (0: the training loop, 1: the background thread that runs
            collectives); the runtime's executors run one lane each, the simulator (:mod:`paratrain.sim`)
            replays the lanes concurrently.
    """

    kind: Kind
    peer: int = -1
    tag: int = 0
    nbytes: int = 0
    items: int = 0
    data: Operand | None = None
    other: Operand | None = None
    out: Slice | None = None
    divide_by: int = 1
    deps: tuple[int, ...] = ()
    label: str = ""
    seconds: float = 0.0
    lane: int = 0

    def __repr__(self) -> str:
        if self.kind == "compute":
            return f"compute({self.label}, {self.seconds:g}s, deps {list(self.deps)})"
        if self.kind == "release":
            return f"release({self.label})"
        if self.kind in ("signal", "wait"):
            return f"{self.kind}({self.tag}, deps {list(self.deps)})"
        if self.kind in ("send", "recv"):
            arrow = "->" if self.kind == "send" else "<-"
            return f"{self.kind}({arrow}{self.peer}, {self.nbytes}B, tag {self.tag}, deps {list(self.deps)})"
        return f"{self.kind}({self.nbytes}B, deps {list(self.deps)})"


class Message(NamedTuple):
    """One message of a plan, as the wire sees it."""

    src: int
    dst: int
    tag: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Plan:
    """The actions of every rank of one schedule.

    Attributes:
        name: what the schedule is, e.g. ``"allreduce/ring"``.
        ranks: ``ranks[r]`` is rank r's actions, in issue order.

    Example:
        >>> b = PlanBuilder()
        >>> _ = b.send(1, Slice("src", 0, 2), itemsize=4)
        >>> p = Plan("demo", (b.actions, (Action("recv", peer=0, nbytes=8, items=2),)))
        >>> p.messages()
        [Message(src=0, dst=1, tag=0, nbytes=8)]
        >>> p.validate()
    """

    name: str
    ranks: tuple[tuple[Action, ...], ...]
    meta: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    def sends(self, rank: int) -> list[Message]:
        """The messages ``rank`` sends, in issue order."""
        return [Message(rank, a.peer, a.tag, a.nbytes) for a in self.ranks[rank] if a.kind == "send"]

    def messages(self) -> list[Message]:
        """Every message, rank by rank, each rank's in issue order."""
        return [m for r in range(self.world_size) for m in self.sends(r)]

    def bytes_sent(self) -> list[int]:
        """Bytes each rank sends."""
        return [sum(m.nbytes for m in self.sends(r)) for r in range(self.world_size)]

    def validate(self) -> None:
        """Checks that every send meets one receive of the same size, and that deps point backwards.

        Raises:
            PlanError: what is wrong, naming the rank and the action.
        """
        sent: dict[tuple[int, int, int], list[int]] = {}
        posted: dict[tuple[int, int, int], list[int]] = {}
        for r, actions in enumerate(self.ranks):
            for i, a in enumerate(actions):
                if any(not 0 <= d < i for d in a.deps):
                    raise PlanError(f"{self.name}: rank {r} action {i} depends on a later action: {a!r}")
                if a.kind in ("send", "recv") and not 0 <= a.peer < self.world_size:
                    raise PlanError(f"{self.name}: rank {r} action {i} names rank {a.peer}, outside the world")
                if a.kind == "send":
                    sent.setdefault((r, a.peer, a.tag), []).append(a.nbytes)
                elif a.kind == "recv":
                    posted.setdefault((a.peer, r, a.tag), []).append(a.nbytes)
        signals = [{a.tag for a in actions if a.kind == "signal"} for actions in self.ranks]
        for r, actions in enumerate(self.ranks):
            for i, a in enumerate(actions):
                if a.kind != "wait":
                    continue
                missing = [q for q in range(self.world_size) if q != r and a.tag not in signals[q]]
                if missing:
                    raise PlanError(f"{self.name}: rank {r} action {i} waits for {a.tag}, never signalled by {missing}")
        for key in sent.keys() | posted.keys():
            out, into = sent.get(key, []), posted.get(key, [])
            if out != into:
                src, dst, tag = key
                raise PlanError(
                    f"{self.name}: rank {src} sends {out} bytes to rank {dst} (tag {tag}) but rank {dst} "
                    f"receives {into}"
                )

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.ranks)


class PlanBuilder:
    """Appends one rank's actions and works out their dependencies, so that generators stay short and exact.

    Rules (the executor relies on them): an action reading a :class:`Received` frame depends on its receive;
    an action writing a :class:`Slice` depends on every earlier send still reading memory it may overlap (so
    a buffer is never overwritten while the transport reads it); sends are then forgotten once waited for.

    Example:
        >>> b = PlanBuilder()
        >>> r = b.recv(1, items=2, itemsize=4)
        >>> s = b.send(1, Slice("dst", 0, 2), itemsize=4)
        >>> b.reduce(Slice("src", 0, 2), Received(r), Slice("dst", 0, 2), itemsize=4)
        2
        >>> b.actions[2].deps
        (0, 1)
    """

    def __init__(self, *, aliased: bool = False, members: Sequence[int] | None = None) -> None:
        #: True when ``src`` and ``dst`` are one array (an in-place call): writes to either wait for sends of both.
        self.aliased = aliased
        #: Group rank -> plan rank for the peers of sends and receives (None: the identity); a composed plan
        #: (e.g. hierarchical) sets it per phase.
        self.members: Sequence[int] | None = members
        self._actions: list[Action] = []
        self._reading: dict[int, Slice] = {}  # sends not yet depended upon -> the memory they read
        # the same, by memory (buffer, index) and sorted by start, with the longest slice per memory, so that a
        # write finds the sends it overlaps without scanning all of them (a ring over N ranks has O(N) live sends)
        self._reading_at: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self._longest: dict[tuple[str, int], int] = {}
        self._fence: set[int] = set()

    def _peer(self, peer: int) -> int:
        return peer if self.members is None else self.members[peer]

    @property
    def actions(self) -> tuple[Action, ...]:
        """The actions so far."""
        return tuple(self._actions)

    def __len__(self) -> int:
        return len(self._actions)

    def fence(self, indices: Iterable[int]) -> None:
        """Makes the next action wait for ``indices`` (and so, issue being serial, everything after it): how a
        phase that blocks until it is complete (the agreement) is joined to the phase that follows it."""
        self._fence.update(indices)

    def _add(self, action: Action) -> int:
        if self._fence:
            action = dataclasses.replace(action, deps=tuple(sorted(self._fence.union(action.deps))))
            self._fence = set()
        self._actions.append(action)
        return len(self._actions) - 1

    def _deps(self, reads: Iterable[Operand | None], writes: Slice | None, extra: Sequence[int]) -> tuple[int, ...]:
        deps = set(extra)
        for operand in reads:
            if isinstance(operand, Received):
                deps.add(operand.action)
        if writes is not None:
            key = self._memory(writes)
            entries = self._reading_at.get(key)
            if entries:
                hi = bisect.bisect_left(entries, (writes.stop, -1, -1))  # entries starting before the write ends
                lo = hi
                reach = writes.start - self._longest[key]  # an entry starting at or before this ends before it
                while lo > 0 and entries[lo - 1][0] > reach:
                    lo -= 1
                hit = [e for e in entries[lo:hi] if writes.start < e[1]]  # and e[0] < writes.stop, by hi
                for entry in hit:
                    deps.add(entry[2])
                    self._reading.pop(entry[2], None)  # (a send of Parts has an entry per part)
                if hit:
                    entries[lo:hi] = [e for e in entries[lo:hi] if e not in hit]
        return tuple(sorted(deps))

    def _memory(self, memory: Slice) -> tuple[str, int]:
        name = "src" if self.aliased and memory.buffer in ("src", "dst") else memory.buffer
        return name, memory.index

    def _reads(self, index: int, memory: Slice) -> None:
        """Records that send ``index`` reads ``memory`` until some write depends on it."""
        self._reading[index] = memory
        key = self._memory(memory)
        bisect.insort(self._reading_at.setdefault(key, []), (memory.start, memory.stop, index))
        self._longest[key] = max(self._longest.get(key, 0), memory.stop - memory.start)

    def send(
        self,
        peer: int,
        data: Operand,
        *,
        itemsize: int,
        items: int | None = None,
        tag: int = 0,
        deps: Sequence[int] = (),
    ) -> int:
        """Appends a send of ``data`` (``items`` is needed for a forwarded frame); returns its number."""
        if items is None:
            if not isinstance(data, Slice):
                raise PlanError("a send of a received frame needs items=")
            items = data.items
        index = self._add(
            Action(
                "send",
                peer=self._peer(peer),
                tag=tag,
                nbytes=items * itemsize,
                items=items,
                data=data,
                deps=self._deps([data], None, deps),
            )
        )
        if isinstance(data, Slice):
            self._reads(index, data)
        return index

    def message(
        self,
        kind: Kind,
        peer: int,
        *,
        nbytes: int,
        items: int = 0,
        data: Operand | None = None,
        tag: int = 0,
        deps: Sequence[int] = (),
        label: str = "",
    ) -> int:
        """Appends a send or receive whose content the executor forms itself (e.g. the agreement's signatures)."""
        index = self._add(
            Action(
                kind,
                peer=self._peer(peer),
                tag=tag,
                nbytes=nbytes,
                items=items,
                data=data,
                deps=self._deps([data], None, deps),
                label=label,
            )
        )
        if kind == "send" and isinstance(data, Slice):
            self._reads(index, data)
        elif kind == "send" and isinstance(data, Parts):
            for part in data.parts:
                self._reads(index, part)
        return index

    def compute(self, label: str, *, seconds: float = 0.0, deps: Sequence[int] = ()) -> int:
        """Appends model code named ``label`` that takes ``seconds`` (for the cost model)."""
        return self._add(Action("compute", label=label, seconds=seconds, deps=tuple(deps)))

    def release(self, label: str) -> int:
        """Appends the letting go of what step ``label``, which does not run here, would have used."""
        return self._add(Action("release", label=label))

    def signal(self, value: int) -> int:
        """Appends the publishing of this rank's counter ``value`` (shared memory)."""
        return self._add(Action("signal", tag=value))

    def wait(self, value: int) -> int:
        """Appends a wait until every other rank signalled ``value`` (shared memory)."""
        return self._add(Action("wait", tag=value))

    def recv(self, peer: int, *, items: int, itemsize: int, tag: int = 0, deps: Sequence[int] = ()) -> int:
        """Appends the posting of a receive; returns its number (use ``Received(number)`` to read it)."""
        return self._add(
            Action("recv", peer=self._peer(peer), tag=tag, nbytes=items * itemsize, items=items, deps=tuple(deps))
        )

    def reduce(self, a: Operand, b: Operand, out: Slice, *, itemsize: int, deps: Sequence[int] = ()) -> int:
        """Appends ``out = a (op) b`` (after ``deps`` too)."""
        found = self._deps([a, b], out, deps)
        return self._add(
            Action("reduce", nbytes=out.items * itemsize, items=out.items, data=a, other=b, out=out, deps=found)
        )

    def copy(self, data: Operand, out: Slice, *, itemsize: int) -> int:
        """Appends ``out = data``."""
        deps = self._deps([data], out, ())
        return self._add(Action("copy", nbytes=out.items * itemsize, items=out.items, data=data, out=out, deps=deps))

    def finish(self, out: Slice, divide_by: int, *, itemsize: int) -> int:
        """Appends the turning of a sum into a mean over ``divide_by`` contributions (a no-op for other ops)."""
        deps = self._deps([], out, ())
        return self._add(
            Action("finish", nbytes=out.items * itemsize, items=out.items, out=out, divide_by=divide_by, deps=deps)
        )
