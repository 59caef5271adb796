"""Replication of a server's chunks to their backups (``KVStore(replicas=R)``, Li et al. OSDI'14's primary-backup).

Every chunk has a replica list of server ranks, given at ``init``; the first live one owns it, and a push is
acknowledged to its worker only when every live replica has it, so an acknowledged update survives the loss of any
R - 1 servers. Two ways, by the chunk's rounds:

* **BSP and SSP: replication after aggregation** (OSDI'14, section 4.3). The owner applies a worker's push and
  tells the other live replicas of it at once, without its data (a ``notice``: worker, sequence number, clock,
  round). When the push's round is complete (every live worker's clock counted, the round's step taken), the owner
  sends each backup the chunk's *state* (value, optimizer state, open rounds, version: what a restarted replica's
  catch-up carries, :mod:`.resync`) with the list of the pushes it holds; the backup installs it in place of its
  own and acknowledges, and the owner answers those pushes. A backup receives and copies one chunk per round, not
  one push per worker, and never steps a round itself, so the replicas cannot differ. A worker that waits for a
  push before its clock completes the round sends ``flush``: the owner sends the states of that worker's pushes at
  once.
* **ASP: every push forwarded** (``replicate``, with the round it joined) and acknowledged by each backup
  (``replicated``) before the worker is answered: rounds of arrival have no point at which a state is complete.

The server's loop never blocks on a backup: pushes awaiting acknowledgements are kept in ``_forwards`` and answered
as they arrive, or at once when a backup is lost. A worker's batch of pushes goes on to each backup in one message
(its notices, or its forwards), states in messages of up to :data:`~.plans.BATCH_BYTES`, acknowledgements in one
message each (:mod:`.protocol`). Pushes carry a per-worker sequence number; a server applies each (worker, sequence)
once, so a push the worker retries on a backup after its owner died is never applied twice nor lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from paratrain._arrays import wire_array
from paratrain.errors import PeerLostError, TransportClosedError
from paratrain.ps.plans import BATCH_BYTES, MAX_BATCH
from paratrain.ps.protocol import REQUEST_TAG, forward_ids, pack, unpack
from paratrain.ps.resync import CATCHING_UP_ERROR, CatchUpError, StoredChunk, chunk_message, read_chunk
from paratrain.ps.rounds import round_of_push
from paratrain.ps.store import RejectedError, ServerStore, lost_push_error
from paratrain.transport.wire import Message

__all__ = ["FORWARDS", "Replication"]

log = logging.getLogger("paratrain.ps.server")

#: Operations that carry forwarded pushes or states (acknowledged, even when refused, so the sender stops waiting).
FORWARDS = ("replicate", "replicate_batch", "replicate_states", "notice")


def _nbytes(arrays: Sequence[Any]) -> int:
    return sum(int(getattr(a, "nbytes", 0)) for a in arrays)


@dataclass
class _Forward:
    """Pushes applied here (one forwarded, or those a chunk's state carries) whose workers are answered once every
    other live replica has them too."""

    answers: list[tuple[int, int]]  # (worker, request id) of each push
    waiting: set[int]  # server ranks that have not acknowledged yet
    error: str | None = None  # a backup rejected it (a bug: replicas hold the same chunks), told to the worker


def _check_state(store: ServerStore, msg: Message) -> tuple[StoredChunk, StoredChunk, list[list[int]]]:
    """The chunk ``store`` holds, the state another replica sent of it (its arrays still the message's), the pushes
    it holds; or why it cannot be installed."""
    meta = msg.meta
    chunk = store.chunk(meta)
    pushes = meta.get("pushes")
    if not isinstance(pushes, list) or not all(
        isinstance(p, list) and len(p) == 3 and all(type(x) is int for x in p) for p in pushes
    ):
        raise RejectedError("state without a valid list of pushes")
    try:
        _, got = read_chunk(msg, servers=store.servers, copy=False)
    except CatchUpError as exc:
        raise RejectedError(str(exc)) from None
    if chunk.owned:  # two owners: a worker took this live server for dead; neither copy may be lost silently
        raise RejectedError(
            f"chunk {meta.get('chunk')} of key {meta.get('key')!r} is owned here: server {msg.src} took it over "
            f"while server {store.transport.rank} is alive (a worker counted it as dead); restart the job"
        )
    if (
        got.dtype_name != chunk.dtype_name
        or got.value.shape != chunk.value.shape
        or sorted(got.state) != sorted(chunk.state)
        or any(got.state[n].shape != chunk.state[n].shape for n in got.state)
    ):
        raise RejectedError(f"state of key {meta.get('key')!r} chunk {meta.get('chunk')} does not fit the chunk")
    return chunk, got, pushes


class Replication:
    """A server's side of replication over ``store``; ``advance`` is the server's: it recomputes the slowest clock
    and answers what became allowed (after a push's data arrived that a pull waited for).

    Attributes:
        active: some chunk here has backups (until then, other servers' deaths and restarts are not watched).
        unsent: chunks whose applied pushes are not yet in a state sent.
    """

    def __init__(self, store: ServerStore, advance: Callable[[], None]) -> None:
        self.store = store
        self._advance = advance
        self.active = False
        self.unsent: set[tuple[Any, int]] = set()
        self._forwards: dict[int, _Forward] = {}
        self._flushing: set[int] = set()  # workers waiting for pushes before their clock (_op_flush)
        self._forward_ids = 0
        self._gone_seen: frozenset[int] = frozenset()  # the lost peers when servers were last checked
        # restarted servers: how often each peer rejoined as last seen
        self._incarnations: dict[int, int] = store.transport.incarnations()
        # while a worker's batch is handled: the forwards to each backup, sent together when it is done
        self._outbox: dict[int, list[tuple[dict[str, Any], Sequence[Any]]]] | None = None
        # restarted workers (.rejoin, set by the server): whether a push (worker, chunk, its clock) is a replacement's
        # of one its predecessor's applied here already, and the record of a push applied (what a replacement's
        # would duplicate)
        self.duplicate: Callable[[int, tuple[Any, int], Any], bool] = lambda worker, key, wclock: False
        self.pushed: Callable[[int, tuple[Any, int], Any], None] = lambda worker, key, wclock: None
        self.newly_lost = False  # a chunk was marked lost (_find_lost_pushes): the server refuses its waiting pulls

    def handlers(self) -> dict[str, Callable[[Message], None]]:
        """The operations other servers (and, ``flush``, workers) send, by name."""
        return {
            "replicate": self._op_replicate,
            "replicate_batch": self._op_replicate_batch,
            "replicate_states": self._op_replicate_states,
            "notice": self._op_notice,
            "replicated": self._op_replicated,
            "flush": self._op_flush,
        }

    def forget(self, worker: int) -> None:
        """``worker``'s clock was counted (or it left, or joined again): its pushes' states go once their round is
        complete, as usual."""
        self._flushing.discard(worker)

    def drop_requests(self, worker: int) -> None:
        """``worker`` died: its pushes still waiting for a state or an acknowledgement go on, but nobody is answered
        for them (a replacement numbers its requests afresh: an answer would reach one of its own)."""
        self._flushing.discard(worker)
        for forward in self._forwards.values():
            forward.answers = [(w, i) for w, i in forward.answers if w != worker]
        for ck in self.unsent:
            chunk = self.store.chunks.get(ck)
            if chunk is not None:
                chunk.unsent = [(w, -1 if w == worker else i, seq, r, c) for w, i, seq, r, c in chunk.unsent]

    def restarted(self, donors: Sequence[int]) -> None:
        """This server caught up after a restart (:mod:`.resync`): the servers that sent no copy are dead to it."""
        self.active = True
        store = self.store
        store.servers_lost |= set(store.servers) - {store.transport.rank} - set(donors)
        self._incarnations = store.transport.incarnations()

    def refuse(self, msg: Message, why: str) -> None:
        """Tells the server that sent forwards or states ``msg`` that they were refused here."""
        ids = forward_ids(msg.meta)
        if ids:
            self._acknowledge(msg.src, ids, [f"backup {why}"] * len(ids))

    def batching(self) -> bool:
        """Starts collecting the forwards of a worker's batch, sent together by :meth:`flush_forwards`; False when
        a batch is collecting already (the outer one sends them)."""
        if self._outbox is not None:
            return False
        self._outbox = {}
        return True

    def check_servers(self, gone: frozenset[int]) -> None:
        """Notices other servers that died (``gone``: the transport's lost peers) or came back as new processes: a
        restarted one is lost as far as this one is concerned (even if its death went unseen) until it has caught
        up from this server's snapshot (:mod:`.donor`)."""
        if not self.active:
            return
        incarnations = self.store.transport.incarnations()
        if incarnations != self._incarnations:
            changed = {s for s, n in incarnations.items() if n != self._incarnations.get(s, 0)}
            changed.discard(self.store.transport.rank)  # (this process's own successor: it is dead itself)
            self._incarnations = incarnations
            self._check_lost_servers(frozenset(changed - self.store.servers_lost))
        if gone != self._gone_seen:
            self._gone_seen = gone
            self._check_lost_servers(gone)

    def push(self, chunk: StoredChunk, msg: Message, seq: int) -> None:
        """A worker's push (sequence number ``seq``) to a chunk with backups: under BSP/SSP applied and made known
        to them (:meth:`_push_aggregated`); under ASP applied and forwarded, answered once every backup has it.
        A push of a dead worker handled after its replacement came is dropped unanswered: the replacement makes it
        again, and an answer would reach one of its own requests."""
        if self.store.stale(msg.src, seq):
            self.store.stats.duplicates += 1
            return
        if chunk.mode == "clock":
            self._push_aggregated(chunk, msg, seq)
            return
        new = self.store.consume(msg.src, seq, msg.meta.get("wclock"))
        ck = (msg.meta["key"], msg.meta["chunk"])
        if new and self.duplicate(msg.src, ck, msg.meta.get("wclock")):
            self.store.stats.duplicates += 1  # a replacement's push that its predecessor's was applied as
            self._forward(chunk, msg, {"skip": True, "id": -1}, ())  # (counted on the backups, applying nothing)
            self.store.reply(msg.src, msg.meta["id"])
            return
        try:
            rows, data = self.store.push_data(chunk, msg)
        except RejectedError:
            if new:  # the backups count it too (applying nothing), so no clock waits for it
                self._forward(chunk, msg, {"skip": True, "id": -1}, ())
            raise
        self.store.stats.pushes += 1
        round_id = round_of_push(chunk.mode, self.store.done[msg.src], chunk.version)
        # forward to the other live replicas first, so that they apply it while this server does (again after a
        # failover: they drop what they already have); the frames are read, never written, so they go zero-copy
        forward_id = self._forward_ids
        arrays = [wire_array(a, name) for a, name in zip(msg.arrays, msg.dtypes, strict=True)]  # bfloat16 stays so
        waiting = self._forward(chunk, msg, {"id": forward_id, "round": round_id}, arrays)
        if new:
            self.store.apply(
                chunk, rows, data, round_id, msg.meta.get("version"), densify=bool(msg.meta.get("densify"))
            )
            self.pushed(msg.src, ck, msg.meta.get("wclock"))
        if waiting:
            self._forward_ids += 1
            self._forwards[forward_id] = _Forward([(msg.src, msg.meta["id"])], waiting)
        else:
            self.store.reply(msg.src, msg.meta["id"])

    def _check_lost_servers(self, gone: frozenset[int]) -> None:
        """Stops waiting for backups that died: their pushes are acknowledged with the replicas still alive."""
        new = sorted(s for s in gone if s in self.store.servers and s not in self.store.servers_lost)
        departed = self.store.transport.departed_peers() if new else frozenset()
        for server in new:
            self.store.servers_lost.add(server)
            if server in departed:  # a clean shutdown, at the end of the job
                log.info("server %d: server %d shut down", self.store.transport.rank, server)
                continue
            self.store.stats.servers_lost.append(server)
            log.warning(
                "server %d: server %d is gone; its chunks fail over to their backups", self.store.transport.rank, server
            )
        if new:
            self._find_lost_pushes()
        for forward_id, forward in list(self._forwards.items()):
            forward.waiting -= self.store.servers_lost
            if not forward.waiting:
                del self._forwards[forward_id]
                self._answer_forward(forward)

    def _find_lost_pushes(self) -> None:
        """Marks the chunks (:attr:`StoredChunk.lost`) that await the data of a dead worker's push of a counted clock
        when every other replica is gone: it died with them, and no replacement makes it again."""
        store = self.store
        me = store.transport.rank
        for (key, index), chunk in store.chunks.items():
            if chunk.lost is not None or not chunk.awaited:
                continue
            if not all(s == me or s in store.servers_lost for s in chunk.replicas):
                continue
            lost = [
                (w, r)
                for (w, seq), r in chunk.awaited.items()
                if (store.stale(w, seq) or w in store.absent) and r < store.done.get(w, 0)
            ]
            if lost:
                chunk.lost = lost_push_error(lost[0][0], lost[0][1], key)
                self.newly_lost = True
                log.error("server %d: key %r chunk %d: %s", me, key, index, chunk.lost)

    def _push_aggregated(self, chunk: StoredChunk, msg: Message, seq: int) -> None:
        """A worker's push to a replicated chunk under BSP/SSP: applied here, made known to the other replicas at
        once (a ``notice``: no data), and answered once a state of the chunk that holds it reached them
        (:meth:`send_states`). A push another replica had applied and told this one of (it died before its
        state came) joins the round it joined there."""
        worker, ck = msg.src, (msg.meta["key"], msg.meta["chunk"])
        wclock = msg.meta.get("wclock")
        wclock = wclock if type(wclock) is int else -1
        noticed = chunk.awaited.pop((worker, seq), None)
        new = self.store.consume(worker, seq, msg.meta.get("wclock"), count=noticed is None)
        if new and self.duplicate(worker, ck, msg.meta.get("wclock")):
            self.store.stats.duplicates += 1  # a replacement's push that its predecessor's was applied as: it goes
            new = False  # on in this chunk's next state, which tells the backups that count it (applying nothing)
        try:
            rows, data = self.store.push_data(chunk, msg)
        except RejectedError:
            if new:  # the backups count it too (applying nothing), so no clock waits for it
                self._forward(chunk, msg, {"op": "notice", "id": -1, "skip": True}, ())
            raise
        chunk.owned = True
        me = self.store.transport.rank
        alone = all(s == me or s in self.store.servers_lost for s in chunk.replicas)  # the last live replica
        if not new:
            # a state of the owner that died had it; it goes on in this one's next state (now), which tells a
            # replica that the dead owner's state did not reach that it holds the push
            if alone:
                self.store.reply(worker, msg.meta["id"])
            else:
                chunk.unsent.append((worker, msg.meta["id"], seq, -1, wclock))
                self.unsent.add(ck)
                self.send_states(flush=worker)
            return
        self.store.stats.pushes += 1
        # (the push's own clock: sent again after its owner died, it may come after the worker's next clock)
        clock = wclock if wclock >= 0 else self.store.done[worker]
        round_id = noticed if noticed is not None else round_of_push(chunk.mode, clock, chunk.version)
        self._forward(chunk, msg, {"op": "notice", "id": -1, "round": round_id}, ())
        self.store.apply(chunk, rows, data, round_id, msg.meta.get("version"), densify=bool(msg.meta.get("densify")))
        self.pushed(worker, ck, wclock)
        if alone:
            self.store.reply(worker, msg.meta["id"])
        else:
            chunk.unsent.append((worker, msg.meta["id"], seq, round_id, wclock))
            self.unsent.add(ck)
        if noticed is not None and self.store.waiting_pulls:
            self._advance()  # a pull (or a round) may have waited for this push's data
        elif round_id < self.store.min_done or worker in self._flushing:
            self.send_states(flush=worker)

    def send_states(self, flush: int | None = None) -> None:
        """Sends the state of every chunk whose pushes of a complete round (or, with ``flush``, of that worker) are
        not yet on the other replicas: to each other live replica, in messages of up to :data:`MAX_BATCH` chunks
        and :data:`BATCH_BYTES` bytes (``replicate_states``), acknowledged in one message each. The workers of the
        pushes a state holds are answered once every replica it went to acknowledged it."""
        me = self.store.transport.rank
        outbox: dict[int, list[tuple[dict[str, Any], list[Any]]]] = {}
        for ck in list(self.unsent):
            chunk = self.store.chunks.get(ck)
            if chunk is None or not chunk.unsent:
                self.unsent.discard(ck)
                continue
            if min(e[3] for e in chunk.unsent) >= self.store.min_done and all(e[0] != flush for e in chunk.unsent):
                continue
            entries, chunk.unsent = chunk.unsent, []
            self.unsent.discard(ck)
            targets = {s for s in chunk.replicas if s != me and s not in self.store.servers_lost}
            forward = _Forward([(worker, request_id) for worker, request_id, *_ in entries], targets)
            if not targets:
                self._answer_forward(forward)
                continue
            forward_id = self._forward_ids
            self._forward_ids += 1
            self._forwards[forward_id] = forward
            meta, arrays = chunk_message(ck[0], ck[1], chunk)
            pushes = [[w, seq, wclock] for w, _, seq, _, wclock in entries]
            meta.update(op="replicate_state", id=forward_id, pushes=pushes)
            for server in targets:
                outbox.setdefault(server, []).append((meta, arrays))
        for server, items in outbox.items():
            start = 0
            while start < len(items):  # messages of up to MAX_BATCH states and BATCH_BYTES (at least one state)
                stop, size = start + 1, _nbytes(items[start][1])
                while stop < len(items) and stop - start < MAX_BATCH and size + _nbytes(items[stop][1]) <= BATCH_BYTES:
                    size += _nbytes(items[stop][1])
                    stop += 1
                self._send_state_batch(server, items[start:stop])
                start = stop

    def _send_state_batch(self, server: int, items: list[tuple[dict[str, Any], list[Any]]]) -> None:
        metas, arrays = pack(items)
        ids = [int(meta["id"]) for meta, _ in items]
        try:
            handle = self.store.transport.isend(
                server, REQUEST_TAG, arrays, {"op": "replicate_states", "id": -1, "ops": metas}
            )
        except (PeerLostError, TransportClosedError) as exc:
            log.warning("server %d: cannot send states to server %d: %s", self.store.transport.rank, server, exc)
            self._unreachable(server, ids)
            return
        self.store.stats.states_sent += len(items)
        self.store.stats.forward_messages += 1
        if not handle.done():  # (sent zero-copy: the chunks wait for it before they change)
            for meta, _ in items:
                self.store.chunks[(meta["key"], meta["chunk"])].sends.append(handle)

    def _op_flush(self, msg: Message) -> None:
        """A worker waits for a push before its clock completes the push's round: its state goes now, and so do
        those of its pushes that arrive before that clock (sent again to this server after their owner died)."""
        self._flushing.add(msg.src)
        self.send_states(flush=msg.src)

    def _op_notice(self, msg: Message) -> None:
        """Another replica applied a worker's push (or, ``skip``, rejected it): counted towards the worker's clock
        here, its data awaited in that replica's next state (or from the worker, should that replica die)."""
        meta = msg.meta
        worker, seq = meta.get("worker"), meta.get("seq")
        if not isinstance(worker, int) or worker not in self.store.done or not isinstance(seq, int):
            raise RejectedError("notice without a valid worker and sequence number")
        chunk = self.store.chunk(meta)
        if meta.get("skip"):
            self.store.consume(worker, seq, meta.get("wclock"))
            return
        round_id = meta.get("round")
        if not isinstance(round_id, int):
            raise RejectedError("notice without a valid round")
        if seq in self.store.applied.get(worker, ()) or (worker, seq) in chunk.awaited:
            return  # known already (a state had it, or its first owner told this one before it died)
        if self.store.stale(worker, seq):
            # a dead worker's push: its replacement's clock does not count it; of a round whose clock was counted
            # here its replacement does not make it again, so the round waits for its data, in this replica's state
            if round_id < self.store.done[worker]:
                chunk.awaited[(worker, seq)] = round_id
            return
        wclock = meta.get("wclock")
        if isinstance(wclock, int):
            self.store.held[(worker, wclock)] = self.store.held.get((worker, wclock), 0) + 1
        chunk.awaited[(worker, seq)] = round_id

    def _op_replicate_states(self, msg: Message) -> None:
        """Another replica's states of chunks (:meth:`send_states`): each checked, all acknowledged in one message,
        then installed in place of this one's, with the pushes each holds. Acknowledged before the copies: from
        then on this process holds the states, and its death would lose them copied or not."""
        try:
            entries = unpack(msg, "ops")
        except ValueError as exc:
            raise RejectedError(f"malformed states: {exc}") from None
        ids: list[int] = []
        errors: list[str | None] = []
        valid: list[tuple[StoredChunk, StoredChunk, list[list[int]]]] = []
        for entry in entries:
            try:
                if entry.meta.get("op") != "replicate_state" or type(entry.meta.get("id")) is not int:
                    raise RejectedError("a states message holds replicate_state entries with integer ids")
                valid.append(_check_state(self.store, entry))
                error = None
            except RejectedError as exc:
                error = f"backup {exc}"
                self.store.stats.rejected += 1
                log.error("server %d rejected a state from server %d: %s", self.store.transport.rank, msg.src, exc)
            ids.extend(forward_ids(entry.meta))
            errors.extend([error] * len(forward_ids(entry.meta)))
        if ids:
            self._acknowledge(msg.src, ids, errors)
        resolved = False
        for chunk, got, pushes in valid:
            resolved = self._install_state(chunk, got, pushes) or resolved
        if resolved and self.store.waiting_pulls:
            self._advance()

    def _install_state(self, chunk: StoredChunk, got: StoredChunk, pushes: list[list[int]]) -> bool:
        """Makes ``chunk`` the state ``got``; whether that brought the data of a push this server awaited."""
        chunk.view = None
        self.store.quiesce(chunk)
        np.copyto(chunk.value, got.value)
        for name, array in got.state.items():
            np.copyto(chunk.state[name], array)
        chunk.pending, chunk.version, chunk.owned = got.pending, got.version, False
        self.store.stats.replicated += len(pushes)
        resolved = False
        for worker, seq, wclock in pushes:
            if worker not in self.store.done:
                continue
            if wclock >= 0:  # (what a replacement of that worker would duplicate, should this replica take over)
                chunk.last_push[worker] = max(chunk.last_push.get(worker, -1), wclock)
            if self.store.stale(worker, seq):
                chunk.awaited.pop((worker, seq), None)  # a dead worker's: its data is here now, nobody counts it
                continue
            applied = self.store.applied.setdefault(worker, set())
            if chunk.awaited.pop((worker, seq), None) is not None:
                resolved = True
            elif seq not in applied and wclock >= 0:  # its notice is still on its way: counted here instead
                self.store.held[(worker, wclock)] = self.store.held.get((worker, wclock), 0) + 1
            applied.add(seq)
        return resolved

    def awaits(self, meta: Mapping[str, Any]) -> bool:
        """Whether a pull must wait for pushes of the rounds it reads whose data this replica does not hold yet."""
        chunk = self.store.chunks.get((meta.get("key"), meta.get("chunk")))  # type: ignore[arg-type]
        if chunk is None or not chunk.awaited:
            return False
        required = meta.get("required")
        return not isinstance(required, int) or min(chunk.awaited.values()) < required

    def _forward(self, chunk: StoredChunk, msg: Message, fields: dict[str, Any], arrays: Sequence[Any]) -> set[int]:
        """Sends worker push ``msg`` on to the chunk's other live replicas (``replicate``); returns their ranks."""
        meta = {
            "op": "replicate",
            "key": msg.meta["key"],
            "chunk": msg.meta["chunk"],
            "worker": msg.src,
            "seq": msg.meta["seq"],
            "wclock": msg.meta.get("wclock"),
            "version": msg.meta.get("version"),
            "rows": bool(msg.meta.get("rows")),
            "densify": bool(msg.meta.get("densify")),
            **fields,
        }
        me = self.store.transport.rank
        sent: set[int] = set()
        for server in chunk.replicas:
            if server == me or server in self.store.servers_lost:
                continue
            if self._outbox is not None:  # inside a worker's batch: sent with the batch's other forwards
                self._outbox.setdefault(server, []).append((meta, arrays))
                sent.add(server)
                self.store.stats.forwarded += 1
                continue
            try:
                self.store.transport.isend(server, REQUEST_TAG, arrays, meta)
            except (PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: cannot forward to server %d: %s", me, server, exc)
                continue
            sent.add(server)
            self.store.stats.forwarded += 1
            self.store.stats.forward_messages += 1
        return sent

    def flush_forwards(self) -> None:
        """Sends the forwards a worker's batch collected, one message per backup (:mod:`.protocol`). A backup
        that cannot be reached is not waited for (as when a forward alone cannot be sent)."""
        outbox, self._outbox = self._outbox or {}, None
        for server, items in outbox.items():
            if len(items) == 1:
                meta, arrays = items[0]
            else:
                metas, arrays = pack(items)
                meta = {"op": "replicate_batch", "id": -1, "ops": metas}
            try:
                self.store.transport.isend(server, REQUEST_TAG, arrays, meta)
                self.store.stats.forward_messages += 1
            except (PeerLostError, TransportClosedError) as exc:
                log.warning("server %d: cannot forward to server %d: %s", self.store.transport.rank, server, exc)
                self._unreachable(server, [m["id"] for m, _ in items])

    def _unreachable(self, server: int, ids: Sequence[int]) -> None:
        """Stops waiting for ``server`` to acknowledge forwards ``ids`` (it cannot be reached: it died)."""
        for forward_id in ids:
            forward = self._forwards.get(forward_id)
            if forward is not None:
                forward.waiting.discard(server)
                if not forward.waiting:
                    del self._forwards[forward_id]
                    self._answer_forward(forward)

    def _op_replicate(self, msg: Message) -> None:
        """A push another replica applied: apply it here in the same round, then acknowledge it to that server."""
        if self._replicate(msg):
            self._acknowledge(msg.src, [msg.meta["id"]], [None])

    def _op_replicate_batch(self, msg: Message) -> None:
        """The forwards of one worker's batch (:mod:`.protocol`): each applied as if it came alone, in order, and
        acknowledged together in one message (a rejected one with its error)."""
        try:
            forwards = unpack(msg, "ops")
        except ValueError as exc:
            raise RejectedError(f"malformed replicate batch: {exc}") from None
        ids: list[int] = []
        errors: list[str | None] = []
        for forward in forwards:
            try:
                if forward.meta.get("op") not in ("replicate", "notice") or type(forward.meta.get("id")) is not int:
                    raise RejectedError("a replicate batch holds replicate requests and notices with integer ids")
                if forward.meta["op"] == "notice":
                    self._op_notice(forward)
                    continue
                if not self._replicate(forward):
                    continue
                error = None
            except RejectedError as exc:
                error = str(exc)
            except Exception as exc:  # as _handle: a bug must not take the server down
                log.exception("server %d: a forward from server %d failed", self.store.transport.rank, msg.src)
                error = f"server error: {type(exc).__name__}: {exc}"
            if error is not None:
                self.store.stats.rejected += 1
                log.error("server %d rejected a forward from server %d: %s", self.store.transport.rank, msg.src, error)
            ids.extend(forward_ids(forward.meta))
            errors.extend([None if error is None else f"backup {error}"] * len(forward_ids(forward.meta)))
        if ids:
            self._acknowledge(msg.src, ids, errors)

    def _acknowledge(self, server: int, ids: list[int], errors: list[str | None]) -> None:
        """Tells ``server`` that its forwards ``ids`` are applied here (or why not, per id)."""
        meta: dict[str, Any] = (
            {"op": "replicated", "id": ids[0], "error": errors[0]}
            if len(ids) == 1
            else {"op": "replicated", "id": -1, "ids": ids, "errors": errors}
        )
        try:
            self.store.transport.isend(server, REQUEST_TAG, (), meta)
        except (PeerLostError, TransportClosedError) as exc:
            log.warning("server %d: cannot acknowledge to server %d: %s", self.store.transport.rank, server, exc)

    def _replicate(self, msg: Message) -> bool:
        """Applies forward ``msg`` here in the round it joined at its owner; whether to acknowledge it.

        It counts towards its worker's clock here (``wclock``) even when it carries nothing to apply (``skip``: its
        owner rejected it, and nobody waits for an acknowledgement), so that the clock is not held back for it."""
        meta = msg.meta
        worker, round_id = meta.get("worker"), meta.get("round")
        if not isinstance(worker, int) or worker not in self.store.done:
            raise RejectedError("replicate without a valid worker")
        chunk = self.store.chunk(meta)
        new = self.store.consume(worker, meta.get("seq"), meta.get("wclock"))
        if meta.get("skip"):
            return False
        if not isinstance(round_id, int):
            raise RejectedError("replicate without a valid round")
        rows, data = self.store.push_data(chunk, msg)
        if new:
            self.store.stats.replicated += 1
            self.store.apply(
                chunk,
                rows,
                data,
                max(round_id, chunk.version) if chunk.mode == "clock" else round_id,
                meta.get("version"),
                densify=bool(meta.get("densify")),
            )
        return True

    def _op_replicated(self, msg: Message) -> None:
        """A backup has forwarded pushes (one, or a batch's): answer each worker once every backup has its push."""
        ids, errors = msg.meta.get("ids"), msg.meta.get("errors")
        if not isinstance(ids, list):
            ids, errors = [msg.meta["id"]], [msg.meta.get("error")]
        if not isinstance(errors, list) or len(errors) != len(ids):
            errors = [None] * len(ids)
        for forward_id, error in zip(ids, errors, strict=True):
            forward = self._forwards.get(forward_id) if type(forward_id) is int else None
            if forward is None:
                continue
            forward.waiting.discard(msg.src)
            if error == CATCHING_UP_ERROR:  # it restarted: lost here until it has this server's copy (.donor)
                self.store.servers_lost.add(msg.src)
            elif isinstance(error, str):
                forward.error = f"server {msg.src}: {error}"
            if not forward.waiting:
                del self._forwards[forward_id]
                self._answer_forward(forward)

    def _answer_forward(self, forward: _Forward) -> None:
        if forward.error is not None:
            self.store.stats.rejected += 1
        for worker, request_id in forward.answers:
            if request_id < 0:
                continue  # (its worker died: nobody to answer)
            if forward.error is None:
                self.store.reply(worker, request_id)
            else:
                self.store.reply(worker, request_id, error=forward.error)
