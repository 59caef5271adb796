"""Bringing a restarted parameter server up to date: a fence at every worker, then a snapshot from its peers.

A replicated job (``replicas=R``) survives a server's death, but with one copy fewer of that server's chunks
until the server comes back. A restarted server process knows nothing: not the keys, not the values, not the
optimizer state, not where each worker's clock stands. It takes all of that from the other live replicas of its
chunks (its *donors*), and it must take it at a point where they agree with one another and with every worker,
or its copy and clock bookkeeping would differ from theirs (the replicas would then take different optimizer
steps). The point is a **fence** per worker:

1. The restarted server connects (the transport's ``hello``, :meth:`~paratrain.transport.base.Transport.incarnations`)
   and waits, serving nothing.
2. Each worker sees it back at its next parameter-server call (or while it waits on one). It waits until every
   push it made is acknowledged (so applied by every live replica), and sends the newcomer a ``fence``: the clock
   it has reached ``f_w``, how many of its pushes since that clock the newcomer's chunks received (``held``), and
   which servers it counts as live. It then waits for the answer, pushing nothing.
3. The newcomer asks the first fence's servers which workers are live (``members``); once every one of them has
   fenced (or left, or died), it asks every donor for a ``snapshot`` at the fences. A donor answers once it has
   counted every fenced worker's clock ``f_w``: with every worker held at its fence, every donor then holds the
   same state, exactly the pushes made before the fences. It sends each chunk the newcomer replicates (value,
   optimizer state, open rounds, version), then its clocks, and from that moment forwards it new pushes again.
4. The newcomer installs the chunks and the clocks (worker w at ``f_w``, with ``held`` of its clock-``f_w``
   pushes already held) and answers every fence. The workers go on; the newcomer is a backup again. Workers
   route to it only when every replica that never died is gone (it is *demoted*), so a rejoin never moves a
   chunk's owner.

Why a fence rather than a copy on the fly: a donor's clocks and open rounds change with every push, and with
several donors (a server's chunks spread over all the others) no two would be copied at the same point. The
fence costs one pause of every worker, as long as the copy takes, once per restart. A worker blocked in a pull
that waits for another worker's clock notices the newcomer while it waits and fences there. A worker can also
wait on another outside the parameter server (a collective among the workers, say) while that one stands at its
fence: so a round of fences has a window (0.1 s, then doubled each time); if some worker has not fenced when it
closes, the fenced ones are released (``retry``) and fence again at their next call, with the newcomer already
known to all. Training goes on meanwhile; the newcomer is a backup only once a round completes. The first window
is short because a failed round costs little; doubling bounds what too short a window wastes for slow steps
(why these lengths: ``benchmarks/recovery/README.md``).

Everything received is checked before use (shapes, dtypes, names); nothing is unpickled.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain._arrays import DTYPE_NAMES
from paratrain.errors import CommTimeoutError, PeerLostError, TransportClosedError
from paratrain.ps.optim import ServerOptimizer, make_optimizer
from paratrain.ps.protocol import CATCHING_UP, REQUEST_TAG, forward_ids, reply_tag
from paratrain.ps.rounds import Mode, RoundSum, mode_of
from paratrain.ps.shared import SharedValue
from paratrain.transport.base import ANY_SOURCE, Handle, Transport
from paratrain.transport.wire import Message

__all__ = ["CATCHING_UP_ERROR", "CatchUpError", "CaughtUp", "StoredChunk", "catch_up", "chunk_message", "read_chunk"]

log = logging.getLogger("paratrain.ps.resync")

#: What a restarted server answers forwards and states sent before their sender saw it restart: the sender counts it
#: lost until it sent its copy (:mod:`.donor`), rather than fail the pushes.
CATCHING_UP_ERROR = "backup is catching up"

#: Seconds the first round of fences may take, from the first fence to the last; each retry doubles it.
FIRST_WINDOW_S = 0.1
# how often a restarted server that no worker has fenced yet asks the others whether any worker is still there
CENSUS_S = 0.5


class CatchUpError(RuntimeError):
    """A restarted server could not be brought up to date (a donor died, a worker never fenced, bad data)."""


@dataclass
class StoredChunk:
    """One chunk as a server stores it: the value, the update rule and its state, the open rounds."""

    value: npt.NDArray[Any]
    dtype_name: str
    key_shape: tuple[int, ...]
    optimizer: ServerOptimizer | None
    state: dict[str, npt.NDArray[Any]]
    consistency: str  # the workers' model: bsp, ssp or asp (the first init's; the others must agree)
    mode: Mode
    staleness_lr: bool
    eager: bool  # reads see a preview of the open rounds (SSP with s > 0, ASP)
    pending: dict[int, RoundSum] = field(default_factory=dict)  # open rounds by id
    view: npt.NDArray[Any] | None = None  # the preview while no push or step changes it (never modified)
    version: int = 0  # rounds applied so far (clock mode: every clock < version is applied)
    sends: list[Handle[None]] = field(default_factory=list)  # replies still reading `value`
    replicas: tuple[int, ...] = ()  # transport ranks of the servers holding this chunk, owner first (replication)
    shared: SharedValue | None = None  # `value` lives there, for same-host workers to read in place (.shared)
    # replication after aggregation (BSP/SSP, the server's docstring): this server takes the workers' pushes (and
    # sends its state to the other replicas); the pushes applied here and not yet in a state sent, as (worker,
    # request id, sequence number, round, its worker's clock or -1); the pushes another replica applied and told
    # this one of, whose data this one has not had yet, as (worker, sequence number) -> round
    owned: bool = False
    unsent: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    awaited: dict[tuple[int, int], int] = field(default_factory=dict)
    # restarted workers (.rejoin): each worker's clock at its last push applied here; the value before the last BSP
    # step and that step's round (what a replacement computing that round again reads)
    last_push: dict[int, int] = field(default_factory=dict)
    # ... and a BSP round's pushes by worker, summed in worker order when it completes (ServerStore.apply)
    ordered: dict[int, dict[int, list[tuple[Any, Any, float, bool]]]] = field(default_factory=dict)
    previous: npt.NDArray[Any] | None = None
    previous_round: int | None = None
    # why the chunk cannot go on exactly (a dead worker's push of a counted clock died with every replica that had
    # its data, .replication): every pull and push of it is refused with this
    lost: str | None = None
    num_chunks: int = 0  # the key's chunks (its placement depends on them all: .membership); 0 if not told


# -- the snapshot of one chunk ------------------------------------------------------------------------------------


def chunk_message(key: str | int, index: int, chunk: StoredChunk) -> tuple[dict[str, Any], list[npt.NDArray[Any]]]:
    """The meta and arrays that carry ``chunk`` to a restarting replica (:func:`read_chunk` reads them).

    An open round's row pushes travel concatenated: a round applies them concatenated anyway, and np.add.at
    over the concatenation adds in the same order as over the parts, so the copy steps bitwise as the original.
    """
    arrays: list[npt.NDArray[Any]] = [chunk.value]
    names = sorted(chunk.state)
    arrays += [chunk.state[name] for name in names]
    rounds = []
    for round_id in sorted(chunk.pending):
        open_round = chunk.pending[round_id]
        if open_round.dense is not None:
            rounds.append([round_id, open_round.count, "dense"])
            arrays.append(open_round.dense)
        elif open_round.rows:
            rounds.append([round_id, open_round.count, "rows"])
            arrays += [np.concatenate(open_round.rows), np.concatenate(open_round.parts)]
        else:
            rounds.append([round_id, open_round.count, "empty"])
    meta = {
        "part": "chunk",
        "key": key,
        "chunk": index,
        "dtype": chunk.dtype_name,
        "key_shape": list(chunk.key_shape),
        "optimizer": chunk.optimizer.spec() if chunk.optimizer is not None else None,
        "consistency": chunk.consistency,
        "staleness_lr": chunk.staleness_lr,
        "eager": chunk.eager,
        "version": chunk.version,
        "replicas": list(chunk.replicas),
        "state": names,
        "rounds": rounds,
        "chunks": chunk.num_chunks,
    }
    return meta, arrays


def read_chunk(msg: Message, *, servers: Sequence[int], copy: bool = True) -> tuple[tuple[str | int, int], StoredChunk]:
    """The chunk a donor sent (:func:`chunk_message`), as a fresh copy this server owns (with ``copy=False`` its
    value and optimizer state are the message's own read-only arrays, for a caller that copies them into place).

    Raises:
        CatchUpError: the message does not describe a valid chunk.
    """
    meta, arrays = msg.meta, list(msg.arrays)
    key, index, dtype_name = meta.get("key"), meta.get("chunk"), meta.get("dtype")
    names, rounds, replicas = meta.get("state"), meta.get("rounds"), meta.get("replicas")
    key_shape, version, consistency = meta.get("key_shape"), meta.get("version"), meta.get("consistency")
    if (
        not isinstance(key, (str, int))
        or type(index) is not int
        or dtype_name not in DTYPE_NAMES
        or not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
        or not isinstance(rounds, list)
        or not isinstance(replicas, list)
        or not all(type(r) is int and r in servers for r in replicas)
        or not isinstance(key_shape, list)
        or not all(type(d) is int for d in key_shape)
        or type(version) is not int
        or consistency not in ("bsp", "ssp", "asp")
        or not arrays
        or msg.dtypes[0] != dtype_name
    ):
        raise CatchUpError(f"malformed snapshot of a chunk from server {msg.src}")
    optimizer = make_optimizer(meta.get("optimizer"))
    value = np.array(arrays[0], copy=True) if copy else np.asarray(arrays[0])
    cursor = 1
    state = {}
    for name in names:
        if cursor >= len(arrays):
            raise CatchUpError(f"snapshot of key {key!r} chunk {index} lacks optimizer state {name!r}")
        state[name] = np.array(arrays[cursor], copy=True) if copy else np.asarray(arrays[cursor])
        cursor += 1
    if optimizer is not None and sorted(optimizer.init_state(value)) != sorted(state):
        raise CatchUpError(f"snapshot of key {key!r} chunk {index}: state {sorted(state)} does not fit {optimizer}")
    pending: dict[int, RoundSum] = {}
    for entry in rounds:
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int and type(entry[1]) is int):
            raise CatchUpError(f"snapshot of key {key!r} chunk {index}: malformed open round")
        round_id, count, kind = entry
        taken = {"dense": 1, "rows": 2, "empty": 0}.get(kind)
        if taken is None or cursor + taken > len(arrays):
            raise CatchUpError(f"snapshot of key {key!r} chunk {index}: open round {round_id} lacks its data")
        open_round = RoundSum(count=count)
        if kind == "dense":
            open_round.dense = np.array(arrays[cursor], copy=True)
            if open_round.dense.shape != value.shape:
                raise CatchUpError(f"snapshot of key {key!r} chunk {index}: round {round_id} has the wrong shape")
        elif kind == "rows":
            open_round.rows = [np.array(arrays[cursor], dtype=np.int64, copy=True)]
            open_round.parts = [np.array(arrays[cursor + 1], copy=True)]
        cursor += taken
        pending[round_id] = open_round
    if cursor != len(arrays):
        raise CatchUpError(f"snapshot of key {key!r} chunk {index} carries {len(arrays) - cursor} arrays too many")
    chunk = StoredChunk(
        value=value,
        dtype_name=str(dtype_name),
        key_shape=tuple(key_shape),
        optimizer=optimizer,
        state=state,
        consistency=str(consistency),
        mode=mode_of(str(consistency)),
        staleness_lr=bool(meta.get("staleness_lr", False)),
        eager=bool(meta.get("eager", False)),
        pending=pending,
        version=version,
        replicas=tuple(replicas),
        num_chunks=num_chunks if type(num_chunks := meta.get("chunks", 0)) is int and num_chunks > index else 0,
    )
    return (key, index), chunk


# -- the restarted server's side ----------------------------------------------------------------------------------


@dataclass
class CaughtUp:
    """What a restarted server installs before it serves (see the module docstring).

    Attributes:
        chunks: every chunk it replicates, as its donors hold them at the fences.
        done: every worker's completed clocks (the fenced ones at their fence).
        live: the workers that take part.
        min_done: the slowest live worker's clock, as the donors had it.
        held: (worker, clock) -> that clock's pushes this server already holds (made before the fence).
        fences: (worker, request id) of each fence, answered once the server installed all this.
        donors: the servers that sent snapshots.
        seconds: from the first fence (of any round) to the last snapshot.
        rounds: rounds of fences it took (1: every worker fenced within the first window).
    """

    chunks: dict[tuple[str | int, int], StoredChunk]
    done: dict[int, int]
    live: set[int]
    min_done: int
    held: dict[tuple[int, int], int]
    fences: list[tuple[int, int]]
    donors: list[int]
    seconds: float
    rounds: int


@dataclass
class _Fence:
    clock: int
    held: int
    request_id: int


def catch_up(transport: Transport, *, servers: Sequence[int], timeout: float, poll: float = 0.2) -> CaughtUp | None:
    """The restarted server's side: collects every live worker's fence, then its donors' snapshots.

    ``servers`` are the job's server ranks (this one included); the others are the donors it may ask.
    Requests from workers other than fences and leaves are refused meanwhile (no worker sends any: each treats
    this server as dead until its fence is answered), as are forwarded pushes (no donor sends any before its
    snapshot). Until the first fence it asks the other servers every :data:`CENSUS_S` seconds which workers
    take part: None when none does any more (the job ended while this server restarted: nothing to serve).

    Raises:
        CatchUpError: no donor answered, a donor died or sent a malformed snapshot, or some worker did not fence
            within ``timeout`` seconds (the caller exits; the workers go on without this server).
    """
    t = transport
    me = t.rank
    deadline = time.monotonic() + timeout
    ids = itertools.count()
    fences: dict[int, _Fence] = {}
    left: set[int] = set()
    members: set[int] | None = None
    donors: list[int] = []
    started: float | None = None
    window, round_ends = FIRST_WINDOW_S, float("inf")
    rounds = 1
    census = time.monotonic()
    while True:
        lost = t.lost_peers()
        now = time.monotonic()
        if members is not None:
            waiting = members - fences.keys() - left - lost
            if not waiting:
                break
            if now > round_ends and now + 2 * window < deadline:
                # some fenced worker may be what the missing ones wait for, outside the parameter server (a
                # collective among the workers, say): release the fenced ones, and try again with a longer window
                log.info("server %d: workers %s did not fence within %.1f s; trying again", me, sorted(waiting), window)
                for worker, fence in fences.items():
                    _answer(t, worker, {"retry": True}, tag=reply_tag(fence.request_id))
                fences.clear()
                window, round_ends = 2 * window, float("inf")
                rounds += 1
        elif now >= census:
            census = now + CENSUS_S
            if not _census(t, servers, lost, ids, timeout):
                log.info("server %d: restarted after every worker left; nothing to serve", me)
                return None
        if now > deadline:
            missing = sorted(members - fences.keys() - left - lost) if members is not None else "(all)"
            raise CatchUpError(
                f"server {me}: restarted, but workers {missing} did not reach a parameter-server call within "
                f"{timeout:g}s, so its copy could not be taken at a point they all agree on; it gives up (the "
                "job goes on without it)"
            )
        try:
            # wake up when the round's window closes, not up to ``poll`` later
            msg = t.recv(ANY_SOURCE, REQUEST_TAG, timeout=max(min(poll, round_ends - now), 0.001))
        except CommTimeoutError:
            continue
        op, request_id = msg.meta.get("op"), msg.meta.get("id")
        if msg.src in servers:
            forwards = forward_ids(msg.meta)
            if forwards:
                errors = [CATCHING_UP_ERROR] * len(forwards)
                _answer(t, msg.src, {"op": "replicated", "id": -1, "ids": forwards, "errors": errors})
            continue
        if op == "fence" and type(request_id) is int and type(msg.meta.get("clock")) is int:
            held = msg.meta.get("held")
            if not fences:
                round_ends = time.monotonic() + window  # a round of fences starts with its first
            fences[msg.src] = _Fence(int(msg.meta["clock"]), held if type(held) is int else 0, request_id)
            if started is None:
                started = time.monotonic()
            if members is None:
                named = msg.meta.get("servers")
                donors = (
                    [s for s in named if type(s) is int and s in servers and s != me] if isinstance(named, list) else []
                )
                members = _members(t, donors, ids, timeout)
        elif op == "leave" and type(request_id) is int:
            left.add(msg.src)
            fences.pop(msg.src, None)
            _answer(t, msg.src, {"done": 0}, tag=reply_tag(request_id))
        elif type(request_id) is int and request_id >= 0:
            _answer(
                t,
                msg.src,
                {"error": f"server {me} is catching up after a restart and serves nothing yet", CATCHING_UP: True},
                tag=reply_tag(request_id),
            )
    assert members is not None
    fenced = {w: f for w, f in fences.items() if w in members and w not in t.lost_peers()}
    chunks, done, min_done, answered = _snapshots(t, donors, fenced, ids, timeout=timeout, servers=servers)
    live = set(fenced)
    for worker, fence in fenced.items():
        done[worker] = fence.clock
    return CaughtUp(
        chunks=chunks,
        done=done,
        live=live,
        min_done=min_done,
        held={(w, f.clock): f.held for w, f in fenced.items() if f.held},
        fences=[(w, f.request_id) for w, f in fences.items() if w not in left],
        donors=answered,
        seconds=time.monotonic() - (started or time.monotonic()),
        rounds=rounds,
    )


def _answer(t: Transport, dst: int, meta: Mapping[str, Any], *, tag: int = REQUEST_TAG) -> None:
    try:
        t.isend(dst, tag, (), meta)
    except (PeerLostError, TransportClosedError) as exc:
        log.warning("server %d: cannot answer rank %d: %s", t.rank, dst, exc)


def _ask(t: Transport, donors: Sequence[int], meta: Mapping[str, Any], ids: itertools.count[int]) -> dict[int, int]:
    """Sends ``meta`` to every donor still connected; returns donor -> request id."""
    asked = {}
    for donor in donors:
        request_id = next(ids)
        try:
            t.isend(donor, REQUEST_TAG, (), {**meta, "id": request_id})
        except (PeerLostError, TransportClosedError):
            continue
        asked[donor] = request_id
    return asked


def _census(
    t: Transport, servers: Sequence[int], lost: frozenset[int] | set[int], ids: itertools.count[int], timeout: float
) -> bool:
    """Whether any worker still takes part, as the other live servers count them; without any, whether a worker is
    still connected (none: the job ended; one: it fences here, and the copy it asks for fails, as no server answers;
    a worker that exited before this server connected may still look connected for a moment)."""
    others = [s for s in servers if s != t.rank and s not in lost]
    if others:
        return bool(_members(t, others, ids, timeout))
    return not all(w in lost for w in range(t.world_size) if w not in servers)


def _members(t: Transport, donors: Sequence[int], ids: itertools.count[int], timeout: float) -> set[int]:
    """The workers every answering donor counts as live (one that left at one donor has left)."""
    members: set[int] | None = None
    for donor, request_id in _ask(t, donors, {"op": "members"}, ids).items():
        try:
            live = t.recv(donor, reply_tag(request_id), timeout=timeout).meta.get("live")
        except PeerLostError:
            continue
        if not isinstance(live, list) or not all(type(w) is int for w in live):
            raise CatchUpError(f"server {t.rank}: malformed member list from server {donor}")
        members = set(live) if members is None else members & set(live)
    if members is None:
        raise CatchUpError(f"server {t.rank}: restarted, but none of servers {list(donors)} answered: no copy to take")
    return members


def _snapshots(
    t: Transport,
    donors: Sequence[int],
    fences: Mapping[int, _Fence],
    ids: itertools.count[int],
    *,
    timeout: float,
    servers: Sequence[int],
) -> tuple[dict[tuple[str | int, int], StoredChunk], dict[int, int], int, list[int]]:
    """Every donor's chunks of this server at the fences, their clocks and slowest clock, and who answered."""
    fence_list = [[w, f.clock] for w, f in sorted(fences.items())]
    chunks: dict[tuple[str | int, int], StoredChunk] = {}
    done: dict[int, int] = {}
    min_done = 0
    answered = []
    for donor, request_id in _ask(t, donors, {"op": "snapshot", "fences": fence_list}, ids).items():
        tag = reply_tag(request_id)
        try:
            while True:
                msg = t.recv(donor, tag, timeout=timeout)
                if msg.meta.get("part") != "chunk":
                    break
                where, chunk = read_chunk(msg, servers=servers)
                chunks.setdefault(where, chunk)  # with R > 2 several donors send the same chunk, all alike
        except PeerLostError as exc:
            raise CatchUpError(f"server {t.rank}: donor server {donor} died while sending its copy: {exc}") from None
        clocks, slowest = msg.meta.get("done"), msg.meta.get("min_done")
        if (
            msg.meta.get("part") != "end"
            or not isinstance(clocks, list)
            or not all(isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in clocks)
            or type(slowest) is not int
        ):
            raise CatchUpError(f"server {t.rank}: malformed end of snapshot from server {donor}")
        for worker, count in clocks:
            done[worker] = max(done.get(worker, 0), count)
        min_done = max(min_done, slowest)
        answered.append(donor)
    if not answered:
        raise CatchUpError(f"server {t.rank}: no donor sent a copy (servers {list(donors)})")
    return chunks, done, min_done, answered
