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

from paratrain.plan.ir import Plan, PlanError
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
    n = plan.world_size
    slow = list(slowdown) if slowdown is not None else [1.0] * n
    if len(slow) != n:
        raise PlanError(f"{plan.name}: slowdown has {len(slow)} entries for {n} ranks")
    ranks = plan.ranks
    done: list[list[float]] = [[_UNKNOWN] * len(actions) for actions in ranks]
    # per rank: lane -> its action numbers in issue order
    lanes: list[dict[int, list[int]]] = []
    for actions in ranks:
        by_lane: dict[int, list[int]] = {}
        for i, a in enumerate(actions):
            by_lane.setdefault(a.lane, []).append(i)
        lanes.append(by_lane)
    cursor: dict[tuple[int, int], int] = {}
    clock: dict[tuple[int, int], float] = {}
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    for r in range(n):
        for lane in lanes[r]:
            cursor[(r, lane)] = 0
            clock[(r, lane)] = 0.0
            heap.append((0.0, seq, r, lane))
            seq += 1
    heapq.heapify(heap)
    waiters: dict[tuple[int, int], list[tuple[int, int]]] = {}
    scanned: dict[tuple[int, int], int] = {}  # (rank, action) -> how many of its deps are known complete
    arrived: dict[tuple[int, int, int], deque[float]] = {}
    posted: dict[tuple[int, int, int], deque[tuple[int, int]]] = {}
    signals: dict[int, dict[int, float]] = {}  # tag -> rank -> when signalled
    sig_waiters: dict[int, list[tuple[int, int]]] = {}
    egress: dict[Any, float] = {}
    ingress: dict[Any, float] = {}
    queue_bytes: dict[Any, int] = {}
    busy, waiting, comm_busy = [0.0] * n, [0.0] * n, [0.0] * n
    bytes_out = [0] * n
    spans: list[dict[str, Any]] = []
    # shared cores: per host, the computing ranks' [work left (seconds alone), rank, lane, action, start]
    pool: dict[int, list[list[Any]]] = {}
    pool_time: dict[int, float] = {}
    pool_version: dict[int, int] = {}

    def host(r: int) -> int:
        return 0 if cores is None or cores.host_of is None else cores.host_of(r)

    def rate(h: int) -> float:
        assert cores is not None
        return min(1.0, cores.capacity / max(1, len(pool.get(h, ()))))

    def advance(h: int, t: float) -> None:
        """Progress the host's computing ranks to ``t``."""
        elapsed = t - pool_time.get(h, 0.0)
        if elapsed > 0:
            step = elapsed * rate(h)
            for job in pool.get(h, ()):
                job[0] -= step
        pool_time[h] = max(t, pool_time.get(h, 0.0))

    def reschedule(h: int) -> None:
        """Put the host's next finish on the heap (older entries go stale by version)."""
        nonlocal seq
        pool_version[h] = pool_version.get(h, 0) + 1
        jobs = pool.get(h)
        if jobs:
            first = pool_time[h] + max(0.0, min(job[0] for job in jobs)) / rate(h)
            heapq.heappush(heap, (first, seq, -1 - h, pool_version[h]))
            seq += 1

    def finish_computes(h: int, now: float) -> None:
        """The host's computing ranks whose work is done complete now; their lanes go on."""
        nonlocal seq
        advance(h, now)
        jobs = pool.get(h, [])
        left = min(job[0] for job in jobs) if jobs else 0.0
        finished = [job for job in jobs if job[0] <= left + 1e-12]
        pool[h] = [job for job in jobs if job[0] > left + 1e-12]
        for _, r, lane, i, start in finished:
            if lane == 0:
                busy[r] += now - start
            else:
                comm_busy[r] += now - start
            if trace:
                span(r, "compute", ranks[r][i].label or "compute", start, now)
            clock[(r, lane)] = now
            complete(r, i, now)
            heapq.heappush(heap, (now, seq, r, lane))
            seq += 1
        reschedule(h)

    def complete(r: int, i: int, t: float) -> None:
        nonlocal seq
        done[r][i] = t
        for r2, lane2 in waiters.pop((r, i), ()):
            heapq.heappush(heap, (max(t, clock[(r2, lane2)]), seq, r2, lane2))
            seq += 1

    def span(r: int, track: str, name: str, start: float, end: float) -> None:
        spans.append(
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

    while heap:
        now, _, r, lane = heapq.heappop(heap)
        if r < 0:  # a host's next compute finish (lane: the pool's version when it was scheduled)
            if lane == pool_version.get(-1 - r):
                finish_computes(-1 - r, now)
            continue
        key = (r, lane)
        order = lanes[r][lane]
        actions = ranks[r]
        while cursor[key] < len(order):
            i = order[cursor[key]]
            a = actions[i]
            deps, pos = a.deps, scanned.get((r, i), 0)  # deps only ever complete: resume the scan where it stopped
            while pos < len(deps) and done[r][deps[pos]] >= 0:
                pos += 1
            if pos < len(deps):
                scanned[(r, i)] = pos
                waiters.setdefault((r, deps[pos]), []).append(key)
                break
            ready = max([clock[key], *(done[r][d] for d in a.deps)])
            if a.kind == "wait" and symmetric is not None:  # every other rank signalled when this one did
                ready = max(ready, signals.get(a.tag, {}).get(r, ready) + network.shm_alpha)
            elif a.kind == "wait":
                tag_signals = signals.get(a.tag, {})
                if len(tag_signals) < n - 1 + (r in tag_signals):
                    sig_waiters.setdefault(a.tag, []).append(key)
                    break
                ready = max(ready, max(t for q, t in tag_signals.items() if q != r) + network.shm_alpha)
            if ready > now:  # not yet: come back then, so that queues see events in time order
                heapq.heappush(heap, (ready, seq, r, lane))
                seq += 1
                break
            if ready > clock[key] and lane == 0 and trace:
                span(r, "waiting", "wait", clock[key], ready)
            if lane == 0:
                waiting[r] += ready - clock[key]
            cursor[key] += 1
            kind = a.kind
            if kind == "send":
                link, out_q, in_q = network.route(r, a.peer)
                if symmetric is not None:
                    in_q = ("in", r)  # the image of this message arrives here
                tx = a.nbytes * link.beta
                begin = max(ready, egress.get(out_q, 0.0))
                egress[out_q] = begin + tx
                arrive = begin + tx + link.alpha
                visible = max(arrive, ingress.get(in_q, 0.0) + a.nbytes * link.receive_beta)
                ingress[in_q] = visible
                queue_bytes[out_q] = queue_bytes.get(out_q, 0) + a.nbytes
                bytes_out[r] += a.nbytes
                if trace:
                    span(r, "network", f"->{a.peer} {a.nbytes}B", begin, visible)
                mkey = (r, a.peer, a.tag) if symmetric is None else ((-a.peer) % symmetric, r, a.tag)
                waiting_recvs = posted.get(mkey)
                if waiting_recvs:
                    r2, i2 = waiting_recvs.popleft()
                    complete(r2, i2, visible)
                else:
                    arrived.setdefault(mkey, deque()).append(visible)
                complete(r, i, visible)
                clock[key] = ready
            elif kind == "recv":
                mkey = (a.peer, r, a.tag)
                got = arrived.get(mkey)
                clock[key] = ready
                if got:
                    complete(r, i, max(ready, got.popleft()))
                else:
                    posted.setdefault(mkey, deque()).append((r, i))
            elif kind == "signal":
                signals.setdefault(a.tag, {})[r] = ready
                clock[key] = ready
                complete(r, i, ready)
                if symmetric is None and len(signals[a.tag]) >= n - 1:
                    for r2, lane2 in sig_waiters.pop(a.tag, ()):
                        heapq.heappush(heap, (max(ready, clock[(r2, lane2)]), seq, r2, lane2))
                        seq += 1
            elif kind == "compute" and cores is not None:  # shares the host's cores until its work is done
                h = host(r)
                start = max(ready, pool_time.get(h, 0.0))
                advance(h, start)
                pool.setdefault(h, []).append([a.seconds * slow[r] * cores.alone, r, lane, i, start])
                reschedule(h)
                break  # the lane goes on when the host finishes this compute
            else:
                if kind == "compute":
                    cost = a.seconds * slow[r]
                elif kind == "copy":
                    cost = a.nbytes * copy
                elif kind == "wait":
                    cost = 0.0
                else:  # reduce, finish
                    cost = a.nbytes * gamma
                end = ready + cost
                if lane == 0:
                    busy[r] += cost
                else:
                    comm_busy[r] += cost
                if trace and cost > 0:
                    track = "compute" if kind == "compute" else "communication"
                    span(r, track, a.label or kind, ready, end)
                clock[key] = end
                complete(r, i, end)
            if clock[key] > now:
                heapq.heappush(heap, (clock[key], seq, r, lane))
                seq += 1
                break
    stuck = [r for r in range(n) if any(t < 0 for t in done[r])]
    if stuck:
        r = stuck[0]
        i = next(i for i, t in enumerate(done[r]) if t < 0)
        raise PlanError(f"{plan.name}: deadlock: rank {r} never completes action {i} ({ranks[r][i]!r})")
    return Replay(
        finish=[max(row, default=0.0) for row in done],
        busy=busy,
        waiting=waiting,
        comm_busy=comm_busy,
        bytes_out=bytes_out,
        queue_bytes=queue_bytes,
        done=done,
        spans=spans,
    )
