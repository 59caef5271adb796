"""The discrete-event replay of a plan: threads (lanes) per rank, links with queues, compute that takes time.

Where :mod:`paratrain.plan.cost` gives one thread per rank and one outgoing link, this engine replays what a
training step really does, from the same :class:`~paratrain.plan.ir.Plan` objects the runtime executes:

* **lanes**: each rank runs its actions on several in-order threads (``Action.lane``): lane 0 is the training
  loop (forward, backward, optimizer), lane 1 the background thread that runs collectives and pushes, so a
  bucket's allreduce overlaps the rest of backward exactly as far as dependencies allow. An action starts when
  its lane reaches it and its ``deps`` (on any lane of its rank) are complete.
* **links** (the fault injector's model, :mod:`paratrain.transport.faults`, generalised to several paths): a
  message of ``n`` bytes over a path with Hockney parameters (alpha, beta) waits for the sender's egress queue,
  occupies it ``n·beta``, arrives ``alpha`` after its last byte left, and becomes visible to the receiver no
  sooner than ``n·beta`` after the previous message into the same ingress queue did. Queues are per *node*
  of the path: a rank's own for paths inside a host (each process has its socket), the host's for paths between
  hosts (one NIC), so many workers into one parameter server, or one host's ranks out through one NIC, share
  the bandwidth, and a ring does not.
* **costs**: ``compute`` takes its seconds times the rank's slowdown (stragglers); ``reduce`` and ``finish``
  take ``gamma`` per byte, ``copy`` takes ``copy`` per byte; ``wait`` (shared memory) completes the ``shm``
  path's alpha after the last of the other ranks' matching ``signal``.
* **shared cores** (optional, :class:`Cores`): processes of one host that compute at the same moment share its
  cores (processor sharing): with k computing, each progresses at min(1, capacity / k) of its speed alone. A
  profile measured with N processes at once already holds the N-way share; replayed with all N computing it
  gives the profiled times, and a pipeline stage that computes while the others wait runs at its speed alone.

Events are processed in time order (a heap of lane wake-ups), so a queue serves messages in the order they
were sent. Sends and receive postings do not block their lane (as in the runtime); whatever depends on a
receive waits for the message to be visible. The result has each rank's finish time, its busy and waiting time
on lane 0, bytes per link queue, and optionally the spans of a Chrome trace in the format of a real run's
``timeline.json`` (:mod:`paratrain.train.record`), so a prediction and a run can be laid side by side.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paratrain.plan.ir import Action, Plan, PlanError
from paratrain.sim.machine import LinkCost

__all__ = ["Cores", "Network", "Replay", "replay"]

_UNKNOWN = -1.0  # a completion time not known yet (times are >= 0)

#: Chrome-trace tracks, as a real run's timeline names them (:mod:`paratrain.train.record`), plus the wire.
TRACKS = {"compute": 1, "communication": 2, "waiting": 3, "network": 5}


@dataclass(frozen=True)
class Network:
    """How a message from one rank to another travels.

    Attributes:
        route: ``route(src, dst)`` -> (path cost, egress queue key, ingress queue key). Two messages that name
            the same queue key share that queue (see the module docstring).
        shm_alpha: latency of a shared-memory signal (for ``wait``).

    Example:
        >>> net = Network.uniform(LinkCost(alpha=1e-3, beta=1e-6))
        >>> net.route(0, 1)
        (LinkCost(alpha=0.001, beta=1e-06, ingress_beta=None), ('out', 0), ('in', 1))
    """

    route: Callable[[int, int], tuple[LinkCost, Any, Any]]
    shm_alpha: float = 0.0

    @staticmethod
    def uniform(link: LinkCost, *, shm_alpha: float = 0.0) -> Network:
        """Every rank a node of its own with one link of ``link``'s parameters (a switch; the fault injector)."""
        return Network(lambda s, d: (link, ("out", s), ("in", d)), shm_alpha=shm_alpha)

    @staticmethod
    def hosts(host_of: Callable[[int], int], intra: LinkCost, inter: LinkCost, *, shm_alpha: float = 0.0) -> Network:
        """Ranks on hosts: inside a host each rank has its own queues on ``intra``; between hosts a host's ranks
        share its NIC (``inter``)."""

        def route(s: int, d: int) -> tuple[LinkCost, Any, Any]:
            hs, hd = host_of(s), host_of(d)
            if hs == hd:
                return intra, ("out", s), ("in", d)
            return inter, ("nic-out", hs), ("nic-in", hd)

        return Network(route, shm_alpha=shm_alpha)


@dataclass(frozen=True)
class Cores:
    """How a host's processes share its cores when they compute at once (processor sharing).

    Attributes:
        capacity: cores' worth of compute per host: with k ranks of a host computing, each runs at
            min(1, capacity / k) of its speed alone. On a measured machine this is what the profile observed
            (N processes at once ran 1/f as fast as one alone: capacity N / f), not the nominal core count.
        alone: seconds alone per second of a plan's ``compute`` (whose times were profiled N-way shared: 1 / f).
        host_of: each rank's host; None: all on one.

    Example:
        Two ranks of one core, with times profiled 2-way shared (alone they take half): together they take
        their profiled times; once the shorter one is done, the other runs at its speed alone.

        >>> from paratrain.plan.ir import Action, Plan
        >>> net, cores = Network.uniform(LinkCost(0.0, 0.0)), Cores(capacity=1.0, alone=0.5)
        >>> both = Plan("c", ((Action("compute", seconds=1.0),), (Action("compute", seconds=1.0),)))
        >>> replay(both, net, cores=cores).finish
        [1.0, 1.0]
        >>> uneven = Plan("c", ((Action("compute", seconds=1.0),), (Action("compute", seconds=0.5),)))
        >>> replay(uneven, net, cores=cores).finish
        [0.75, 0.5]
    """

    capacity: float
    alone: float = 1.0
    host_of: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        if not self.capacity > 0 or not self.alone > 0:
            raise PlanError(f"cores: capacity and alone must be > 0, got {self.capacity} and {self.alone}")


@dataclass
class Replay:
    """What a replay found.

    Attributes:
        finish: when each rank's last action completed (seconds from the start).
        busy: per rank, seconds lane 0 spent running actions (compute, reduce, copy).
        waiting: per rank, seconds lane 0 stood waiting for a dependency (a message, a bucket).
        comm_busy: per rank, seconds the other lanes spent running actions.
        bytes_out: bytes each rank sent.
        queue_bytes: bytes through each egress queue key.
        done: ``done[r][i]``: when action i of rank r completed.
        spans: Chrome-trace events (only with ``trace=True``).
    """

    finish: list[float]
    busy: list[float]
    waiting: list[float]
    comm_busy: list[float]
    bytes_out: list[int]
    queue_bytes: dict[Any, int]
    done: list[list[float]]
    spans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def time(self) -> float:
        """The makespan: when the last rank finished."""
        return max(self.finish, default=0.0)

    def chrome_trace(self, *, offset_s: float = 0.0) -> dict[str, Any]:
        """The spans as a Chrome trace (``{"traceEvents": [...]}``), one process per rank, as a run's timeline."""
        events = [dict(e, ts=e["ts"] + offset_s * 1e6) for e in self.spans]
        for rank in range(len(self.finish)):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (sim)"}})
            for track, tid in TRACKS.items():
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def replay(
    plan: Plan,
    network: Network,
    *,
    gamma: float = 0.0,
    copy: float = 0.0,
    slowdown: Sequence[float] | None = None,
    trace: bool = False,
    validate: bool = True,
    symmetric: int | None = None,
    cores: Cores | None = None,
) -> Replay:
    """Replays ``plan`` on ``network`` under the model of the module docstring.

    Args:
        plan: any plan; actions carry their lane.
        network: the routes and their costs.
        gamma: seconds per byte of ``reduce`` and ``finish``.
        copy: seconds per byte of ``copy``.
        slowdown: per rank, the factor its ``compute`` actions take longer (1 = nominal).
        trace: also record Chrome-trace spans.
        validate: check the plan first (off for plans built by trusted composers, to save time at scale).
        symmetric: the world size N of a plan given by rank 0's actions alone, every rank r's being rank 0's
            with peers shifted by r (a ring, "direct", the agreement; a data-parallel step over them), on a
            network where every rank's links are alike. Then every rank lives the same timeline, so rank 0's
            k-th receive from peer p (tag t) is the image of its own k-th send to -p mod N (tag t), and its
            ingress queue sees the images of its own sends: one rank's replay is exact for all, in O(its
            actions) instead of O(N x its actions) (a 1024-rank ring step in a fraction of a second).
        cores: share each host's cores among the ranks computing at once (:class:`Cores`); None: every
            ``compute`` takes its seconds whatever the others do. Not with ``symmetric``.

    Raises:
        PlanError: the plan is malformed or deadlocks (some action waits for something that never happens).

    Example:
        Two ranks, one computing while the other's message travels:

        >>> from paratrain.plan.ir import Action
        >>> r0 = (Action("compute", seconds=2.0), Action("send", peer=1, nbytes=1000))
        >>> r1 = (Action("recv", peer=0, nbytes=1000), Action("compute", seconds=1.0, deps=(0,)))
        >>> out = replay(Plan("demo", (r0, r1)), Network.uniform(LinkCost(alpha=0.5, beta=1e-3)))
        >>> out.finish, out.waiting
        ([3.5, 4.5], [0.0, 3.5])
    """
    if validate and symmetric is None:
        plan.validate()
    if symmetric is not None and plan.world_size != 1:
        raise PlanError(f"{plan.name}: a symmetric replay takes rank 0's actions only, got {plan.world_size} ranks")
    if symmetric is not None and cores is not None:
        raise PlanError(f"{plan.name}: shared cores need every rank's actions, not a symmetric replay")
    slow = list(slowdown) if slowdown is not None else [1.0] * plan.world_size
    if len(slow) != plan.world_size:
        raise PlanError(f"{plan.name}: slowdown has {len(slow)} entries for {plan.world_size} ranks")
    run = _Replayer(plan, network, gamma=gamma, copy=copy, slow=slow, trace=trace, symmetric=symmetric)
    if cores is not None:
        run.cores = _SharedCores(cores, run)
    return run.run()


class _SharedCores:
    """Processor sharing of each host's cores (:class:`Cores`): the computing ranks' work left, and when the
    next of them finishes (a heap entry of rank ``-1 - host``, stale once the host's version moves on)."""

    def __init__(self, cores: Cores, run: _Replayer) -> None:
        self.cores, self.run = cores, run
        # per host: the computing ranks' [work left (seconds alone), rank, lane, action, start]
        self.pool: dict[int, list[list[Any]]] = {}
        self.time: dict[int, float] = {}
        self.version: dict[int, int] = {}

    def host(self, r: int) -> int:
        return 0 if self.cores.host_of is None else self.cores.host_of(r)

    def rate(self, h: int) -> float:
        return min(1.0, self.cores.capacity / max(1, len(self.pool.get(h, ()))))

    def advance(self, h: int, t: float) -> None:
        """Progress the host's computing ranks to ``t``."""
        elapsed = t - self.time.get(h, 0.0)
        if elapsed > 0:
            step = elapsed * self.rate(h)
            for job in self.pool.get(h, ()):
                job[0] -= step
        self.time[h] = max(t, self.time.get(h, 0.0))

    def start(self, r: int, lane: int, i: int, seconds: float, ready: float) -> None:
        """Rank ``r`` starts ``seconds`` of compute (measured shared) on its host, no sooner than ``ready``."""
        h = self.host(r)
        start = max(ready, self.time.get(h, 0.0))
        self.advance(h, start)
        self.pool.setdefault(h, []).append([seconds * self.cores.alone, r, lane, i, start])
        self._reschedule(h)

    def wake(self, h: int, version: int, now: float) -> None:
        """A heap entry of host ``h`` fell due: its computing ranks whose work is done complete now."""
        if version != self.version.get(h):
            return  # stale: the host's pool changed since
        self.advance(h, now)
        jobs = self.pool.get(h, [])
        left = min(job[0] for job in jobs) if jobs else 0.0
        finished = [job for job in jobs if job[0] <= left + 1e-12]
        self.pool[h] = [job for job in jobs if job[0] > left + 1e-12]
        for _, r, lane, i, start in finished:
            self.run.computed(r, lane, i, start, now)
        self._reschedule(h)

    def _reschedule(self, h: int) -> None:
        """Put the host's next finish on the heap (older entries go stale by version)."""
        self.version[h] = self.version.get(h, 0) + 1
        jobs = self.pool.get(h)
        if jobs:
            first = self.time[h] + max(0.0, min(job[0] for job in jobs)) / self.rate(h)
            self.run.push(first, -1 - h, self.version[h])


class _Replayer:
    """One replay's state: the lanes' cursors and clocks, the heap of their wake-ups, messages in flight and
    posted receives, the link queues, and what :class:`Replay` reports. One small method per action kind."""

    def __init__(
        self,
        plan: Plan,
        network: Network,
        *,
        gamma: float,
        copy: float,
        slow: list[float],
        trace: bool,
        symmetric: int | None,
    ) -> None:
        n = plan.world_size
        self.plan, self.network, self.n = plan, network, n
        self.gamma, self.copy, self.slow, self.trace, self.symmetric = gamma, copy, slow, trace, symmetric
        self.cores: _SharedCores | None = None
        self.ranks = plan.ranks
        self.done: list[list[float]] = [[_UNKNOWN] * len(actions) for actions in self.ranks]
        # per rank: lane -> its action numbers in issue order
        self.lanes: list[dict[int, list[int]]] = []
        for actions in self.ranks:
            by_lane: dict[int, list[int]] = {}
            for i, a in enumerate(actions):
                by_lane.setdefault(a.lane, []).append(i)
            self.lanes.append(by_lane)
        self.cursor: dict[tuple[int, int], int] = {}
        self.clock: dict[tuple[int, int], float] = {}
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        for r in range(n):
            for lane in self.lanes[r]:
                self.cursor[(r, lane)] = 0
                self.clock[(r, lane)] = 0.0
                self.heap.append((0.0, self.seq, r, lane))
                self.seq += 1
        heapq.heapify(self.heap)
        self.waiters: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.scanned: dict[tuple[int, int], int] = {}  # (rank, action) -> how many of its deps are known complete
        self.arrived: dict[tuple[int, int, int], deque[float]] = {}
        self.posted: dict[tuple[int, int, int], deque[tuple[int, int]]] = {}
        self.signals: dict[int, dict[int, float]] = {}  # tag -> rank -> when signalled
        self.sig_waiters: dict[int, list[tuple[int, int]]] = {}
        self.egress: dict[Any, float] = {}
        self.ingress: dict[Any, float] = {}
        self.queue_bytes: dict[Any, int] = {}
        self.busy, self.waiting, self.comm_busy = [0.0] * n, [0.0] * n, [0.0] * n
        self.bytes_out = [0] * n
        self.spans: list[dict[str, Any]] = []

    def push(self, t: float, r: int, lane: int) -> None:
        """Wakes lane ``lane`` of rank ``r`` at ``t`` (a negative ``r``: a host's cores, :class:`_SharedCores`)."""
        seq = self.seq
        heapq.heappush(self.heap, (t, seq, r, lane))
        self.seq = seq + 1

    def run(self) -> Replay:
        """Processes the lanes' wake-ups in time order until none is left; the plan must then be done."""
        heap, pop, lane_step = self.heap, heapq.heappop, self._lane
        while heap:
            now, _, r, lane = pop(heap)
            if r >= 0:
                lane_step(now, r, lane)
            else:  # a host's next compute finish (lane: the pool's version when it was scheduled)
                assert self.cores is not None
                self.cores.wake(-1 - r, lane, now)
        return self._result()

    def _lane(self, now: float, r: int, lane: int) -> None:
        """Runs the lane's next actions until one must wait (for a dependency, a message, or the clock)."""
        key = (r, lane)
        order = self.lanes[r][lane]
        actions, done_r = self.ranks[r], self.done[r]
        cursor, clock, scanned = self.cursor, self.clock, self.scanned
        while cursor[key] < len(order):
            i = order[cursor[key]]
            a = actions[i]
            deps, pos = a.deps, scanned.get((r, i), 0)  # deps only ever complete: resume the scan where it stopped
            while pos < len(deps) and done_r[deps[pos]] >= 0:
                pos += 1
            if pos < len(deps):  # woken when that one completes
                scanned[(r, i)] = pos
                self.waiters.setdefault((r, deps[pos]), []).append(key)
                break
            ready = max([clock[key], *(done_r[d] for d in deps)])
            kind = a.kind
            if kind == "wait":
                signalled = self._signalled(key, a.tag, ready)
                if signalled is None:
                    break
                ready = signalled
            if ready > now:  # not yet: come back then, so that queues see events in time order
                self.push(ready, r, lane)
                break
            if lane == 0:
                if ready > clock[key] and self.trace:
                    self._span(r, "waiting", "wait", clock[key], ready)
                self.waiting[r] += ready - clock[key]
            cursor[key] += 1
            if kind == "send":
                self._send(r, i, a, ready)
                clock[key] = ready
            elif kind == "recv":
                clock[key] = ready
                self._recv(r, i, a, ready)
            elif kind == "signal":
                clock[key] = ready
                self._signal(r, i, a, ready)
            elif kind == "compute" and self.cores is not None:  # shares the host's cores until its work is done
                self.cores.start(r, lane, i, a.seconds * self.slow[r], ready)
                break  # the lane goes on when the host finishes this compute
            else:
                clock[key] = self._local(r, lane, i, a, ready)
            if clock[key] > now:
                self.push(clock[key], r, lane)
                break

    def _signalled(self, key: tuple[int, int], tag: int, ready: float) -> float | None:
        """When a shared-memory ``wait`` of lane ``key`` may go on (the path's alpha after every other rank's
        signal of ``tag``), no sooner than ``ready``; None while a signal is missing (the lane is woken then)."""
        r = key[0]
        if self.symmetric is not None:  # every other rank signalled when this one did
            return max(ready, self.signals.get(tag, {}).get(r, ready) + self.network.shm_alpha)
        tag_signals = self.signals.get(tag, {})
        if len(tag_signals) < self.n - 1 + (r in tag_signals):
            self.sig_waiters.setdefault(tag, []).append(key)
            return None
        return max(ready, max(t for q, t in tag_signals.items() if q != r) + self.network.shm_alpha)

    def _send(self, r: int, i: int, a: Action, ready: float) -> None:
        """The message waits for its egress queue, crosses the link, becomes visible through the ingress queue."""
        link, out_q, in_q = self.network.route(r, a.peer)
        symmetric = self.symmetric
        if symmetric is not None:
            in_q = ("in", r)  # the image of this message arrives here
        tx = a.nbytes * link.beta
        begin = max(ready, self.egress.get(out_q, 0.0))
        self.egress[out_q] = begin + tx
        arrive = begin + tx + link.alpha
        visible = max(arrive, self.ingress.get(in_q, 0.0) + a.nbytes * link.receive_beta)
        self.ingress[in_q] = visible
        self.queue_bytes[out_q] = self.queue_bytes.get(out_q, 0) + a.nbytes
        self.bytes_out[r] += a.nbytes
        if self.trace:
            self._span(r, "network", f"->{a.peer} {a.nbytes}B", begin, visible)
        mkey = (r, a.peer, a.tag) if symmetric is None else ((-a.peer) % symmetric, r, a.tag)
        waiting_recvs = self.posted.get(mkey)
        if waiting_recvs:
            r2, i2 = waiting_recvs.popleft()
            self._complete(r2, i2, visible)
        else:
            self.arrived.setdefault(mkey, deque()).append(visible)
        self._complete(r, i, visible)

    def _recv(self, r: int, i: int, a: Action, ready: float) -> None:
        """Completes when the matching message is visible (now, if it already is), without blocking the lane."""
        mkey = (a.peer, r, a.tag)
        got = self.arrived.get(mkey)
        if got:
            self._complete(r, i, max(ready, got.popleft()))
        else:
            self.posted.setdefault(mkey, deque()).append((r, i))

    def _signal(self, r: int, i: int, a: Action, ready: float) -> None:
        """A shared-memory signal; once every other rank's is in, the lanes waiting on the tag go on."""
        self.signals.setdefault(a.tag, {})[r] = ready
        self._complete(r, i, ready)
        if self.symmetric is None and len(self.signals[a.tag]) >= self.n - 1:
            for r2, lane2 in self.sig_waiters.pop(a.tag, ()):
                self.push(max(ready, self.clock[(r2, lane2)]), r2, lane2)

    def _local(self, r: int, lane: int, i: int, a: Action, ready: float) -> float:
        """An action that takes its lane's time (compute, copy, reduce, finish; a ready wait takes none); returns
        when it ends."""
        kind = a.kind
        if kind == "compute":
            cost = a.seconds * self.slow[r]
        elif kind == "copy":
            cost = a.nbytes * self.copy
        elif kind == "wait":
            cost = 0.0
        else:  # reduce, finish
            cost = a.nbytes * self.gamma
        end = ready + cost
        if lane == 0:
            self.busy[r] += cost
        else:
            self.comm_busy[r] += cost
        if self.trace and cost > 0:
            track = "compute" if kind == "compute" else "communication"
            self._span(r, track, a.label or kind, ready, end)
        self._complete(r, i, end)
        return end

    def computed(self, r: int, lane: int, i: int, start: float, now: float) -> None:
        """A compute on shared cores finished at ``now``: its lane goes on."""
        if lane == 0:
            self.busy[r] += now - start
        else:
            self.comm_busy[r] += now - start
        if self.trace:
            self._span(r, "compute", self.ranks[r][i].label or "compute", start, now)
        self.clock[(r, lane)] = now
        self._complete(r, i, now)
        self.push(now, r, lane)

    def _complete(self, r: int, i: int, t: float) -> None:
        self.done[r][i] = t
        woken = self.waiters.pop((r, i), None)
        if woken:
            for r2, lane2 in woken:
                self.push(max(t, self.clock[(r2, lane2)]), r2, lane2)

    def _span(self, r: int, track: str, name: str, start: float, end: float) -> None:
        self.spans.append(
            {
                "name": name,
                "cat": track,
                "ph": "X",
                "ts": start * 1e6,
                "dur": max(0.0, end - start) * 1e6,
                "pid": r,
                "tid": TRACKS[track],
            }
        )

    def _result(self) -> Replay:
        done = self.done
        stuck = [r for r in range(self.n) if any(t < 0 for t in done[r])]
        if stuck:
            r = stuck[0]
            i = next(i for i, t in enumerate(done[r]) if t < 0)
            raise PlanError(f"{self.plan.name}: deadlock: rank {r} never completes action {i} ({self.ranks[r][i]!r})")
        return Replay(
            finish=[max(row, default=0.0) for row in done],
            busy=self.busy,
            waiting=self.waiting,
            comm_busy=self.comm_busy,
            bytes_out=self.bytes_out,
            queue_bytes=self.queue_bytes,
            done=done,
            spans=self.spans,
        )
