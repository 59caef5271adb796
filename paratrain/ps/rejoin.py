"""A parameter-server worker restarted while the job goes on (``paratrain launch --servers S --max-restarts R``).

Li et al. (OSDI'14) restart a dead worker and let it fetch what it needs from the servers; this is that, made
exact. The servers are the only state a worker of a parameter-server job shares with the job: the parameters and
the optimizer's state live there, and a worker's position is its clock (its data order follows from it). So when
a worker dies:

* **Each server holds its place** instead of dropping it from the clock bookkeeping: the worker stays live at the
  clock it had completed, so under BSP and SSP no round it has not pushed to is taken without it (the others wait,
  as they would for a straggler), and its requests still waiting are dropped (their ids die with the process).
  ASP's rounds (every N pushes) count only the workers present meanwhile: nobody waits under ASP.
* **The replacement rejoins** (``rejoin``, :class:`~.client.KVStore` does it when its transport rejoined the job):
  each server answers with the clock it counted for the worker. Its clock messages leave in one burst, so under
  BSP the servers differ by at most one; the replacement resumes at the smallest, the interrupted clock ``c``, and
  computes that clock again. SSP and ASP resume at the largest (their rounds do not wait for exactness).
* **What the dead worker sent counts once.** A server that has the dead worker's push of ``c`` to a chunk
  acknowledges the replacement's without applying it, and a server that counted clock ``c`` already takes neither
  its pushes of ``c`` nor its clock message ``c + 1`` again (pushes of a rejoined worker carry their clock). The
  gradient computed again is the one the dead worker computed (same parameters, same data), so BSP's rounds sum
  the same pushes and the model is bitwise the fault-free run's.
* **The replacement reads the parameters of clock ``c``.** A server that counted clock ``c`` may have taken round
  ``c``'s step already; it keeps each chunk's value from before its last BSP step (one copy of the parameters, one
  ``memcpy`` per round, only in such jobs) and answers the replacement's first pull (``exact``: the version it
  needs) with it.

The launcher's budget bounds the wait: once it is spent a worker's death ends the job, as without restarts. One
push per key and clock is what makes "the dead worker's push of ``c``" well defined: the torch front end pushes
each bucket once per step.

**With replicated servers** (``KVStore(replicas=R, rejoin=True)`` beside ``ParameterServer(worker_restarts=True)``)
the replacement asks the live servers; each process numbers its pushes from its incarnation on
(:meth:`~.store.ServerStore.stale`), so what a dead worker's pushes left in notices and states still counts in the
chunks' data but not towards its replacement's clock; its forwards are answered to nobody; a server restarted
before the replacement connected (or still catching up) is fenced by it as by the others. A server may get the
replacement's ``hello`` before it sees the death (the transport then reports no loss at all): the ``rejoin`` is
handled at once even where the predecessor's clock is held back (waiting for a push a dead owner was to forward),
and holds the place first. A dead worker's push that another replica applied (this one was told, a ``notice``) is
awaited here after the death as before it: a clock counted here is not computed again, so its data must come in
that replica's state; should every replica holding it die first, the push is lost with them, and the chunk refuses
every request, naming it (the job fails rather than take the round's step without it). ``paratrain launch
--replicas R --max-restarts N`` restarts both, from one budget. A push's round and what a replacement's push
duplicates follow the clock the push carries, not the one counted when it arrives: sent again to a backup after its
owner died, it may arrive after the worker's next clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from paratrain.errors import PeerLostError, WorkDoneError
from paratrain.ps.protocol import CATCHING_UP, REQUEST_TAG, PSRequestError
from paratrain.ps.routing import Router
from paratrain.ps.store import INCARNATION_BITS, RejectedError, ServerStore, lost_push_error
from paratrain.transport.wire import Message

__all__ = ["Rejoins", "take_place"]

log = logging.getLogger("paratrain.ps.server")


class Rejoins:
    """A server's side of restarted workers over ``store``; ``purge(worker)`` drops the server's own bookkeeping of
    a worker's requests (held-back and waiting ones).

    Attributes:
        enabled: this job restarts workers (``settings.ps_worker_restarts``): places are held, BSP values kept.
        absent: dead workers whose places are held for a replacement.
    """

    def __init__(
        self, store: ServerStore, purge: Callable[[int], None], *, enabled: bool, restarted: bool = False
    ) -> None:
        self.store = store
        self.enabled = enabled
        self.restarted = restarted  # this server process is a restarted one (replicated: it caught up)
        store.keep_previous = enabled
        self._purge = purge
        self.absent = store.absent
        # worker -> (the clock the server had counted when it rejoined, the chunks holding its push of that clock
        # that a push of the replacement's would duplicate); until the server counts a later clock of it
        self._resumed: dict[int, tuple[int, set[tuple[Any, int]]]] = {}

    def handlers(self) -> dict[str, Callable[[Message], None]]:
        """The operation a restarted worker sends, by name."""
        return {"rejoin": self._op_rejoin}

    def hold(self, worker: int) -> None:
        """``worker`` died: keep its place (its clock, its pushes) for its replacement."""
        self.store.stats.workers_lost.append(worker)
        self.absent.add(worker)
        self._resumed.pop(worker, None)
        self._purge(worker)
        log.warning(
            "server %d: worker %d is gone; its place is held at clock %d for its replacement (--max-restarts)",
            self.store.transport.rank,
            worker,
            self.store.done[worker],
        )

    def _op_rejoin(self, msg: Message) -> None:
        """A replacement takes its rank's place: answered with the clock counted here for that rank."""
        store, worker = self.store, msg.src
        if not self.enabled:
            raise RejectedError("this job does not restart workers (paratrain launch --servers S --max-restarts R)")
        if worker not in store.live:  # it died after its work was done (it left): nothing to take over
            store.reply(worker, msg.meta["id"], left=True)
            return
        if worker not in self.absent:  # replaced before this server saw it die (its hello came first)
            self.hold(worker)
        self.absent.discard(worker)
        self._purge(worker)  # (again: what came since its death, forwards of its pushes, dies with its ids too)
        clock = store.done[worker]
        pushed = {key for key, chunk in store.chunks.items() if chunk.last_push.get(worker) == clock}
        self._resumed[worker] = (clock, pushed)
        # replicated: the replacement's pushes of its clock are counted afresh (those its predecessor's duplicate
        # too, acknowledged without applying), numbered from its incarnation on (ServerStore.stale)
        for held in [k for k in store.held if k[0] == worker and k[1] >= clock]:
            del store.held[held]
        me = store.transport.rank
        for key, chunk in store.chunks.items():
            alone = all(s == me or s in store.servers_lost for s in chunk.replicas)
            for awaited, round_id in [(k, r) for k, r in chunk.awaited.items() if k[0] == worker]:
                if round_id >= clock:
                    del chunk.awaited[awaited]  # (its data comes with the replacement's push of that clock)
                elif alone:  # its data died with the chunk's other replicas and the worker, before any copy
                    raise RejectedError(lost_push_error(worker, round_id, key[0]))
                # (else it comes in another replica's state; should they all die first, .replication marks the
                # chunk lost)
        incarnation = store.transport.incarnations().get(worker, 0)
        log.warning(  # (the counterpart of "worker N is gone", which users see too)
            "server %d: worker %d rejoined at clock %d (%d chunk(s) here hold its push of that clock)",
            store.transport.rank,
            worker,
            clock,
            len(pushed),
        )
        store.reply(worker, msg.meta["id"], clock=clock, incarnation=incarnation, restarted=self.restarted)

    def duplicate(self, worker: int, key: tuple[Any, int], wclock: Any) -> bool:
        """Whether a rejoined worker's push to chunk ``key``, made at its clock ``wclock``, was applied here already
        (its predecessor's): acknowledge it without applying it."""
        resumed = self._resumed.get(worker)
        if resumed is None or not isinstance(wclock, int):
            return False
        clock, pushed = resumed
        if wclock < self.store.done[worker]:
            return True  # this server counted that clock: every push of it is here
        if wclock == clock and key in pushed:
            pushed.discard(key)
            return True
        return False

    def counted_before(self, worker: int, clock: Any) -> bool:
        """Whether a rejoined worker's clock message ``clock`` was counted here already (its predecessor's)."""
        return worker in self._resumed and isinstance(clock, int) and clock <= self.store.done[worker]

    def counted(self, worker: int) -> None:
        """A clock of ``worker`` was counted: past its interrupted clock, nothing of it can be a duplicate."""
        resumed = self._resumed.get(worker)
        if resumed is not None and self.store.done[worker] > resumed[0]:
            del self._resumed[worker]

    def pushed(self, worker: int, key: tuple[Any, int], wclock: Any = None) -> None:
        """A push of ``worker`` to chunk ``key`` was applied (what a replacement's duplicates), made at its clock
        ``wclock``: the clock the push carries, not the one counted here now (a push sent again after its server
        died arrives after the worker's next clock; taken for that clock's, it made the replacement's push of that
        clock look like a duplicate, and the round went on without it)."""
        if self.enabled:
            clock = wclock if type(wclock) is int and wclock >= 0 else self.store.done[worker]
            chunk = self.store.chunks[key]
            chunk.last_push[worker] = max(chunk.last_push.get(worker, -1), clock)


def take_place(router: Router, staleness: int | None, worker: int) -> int:
    """The replacement's side: takes dead ``worker``'s place on ``router``'s servers and returns the clock it
    resumes at: the smallest the servers counted under BSP and SSP(0) (``staleness`` 0: that clock is computed
    again, on its parameters), the largest otherwise (the servers behind are told the clocks in between).

    Raises:
        WorkDoneError: the dead worker had finished and left: there is nothing to take over (a server says so, or
            the servers are gone: they shut down once every worker left; a crashed server fails the job anyway).
    """
    router.replacing = True
    answers: dict[int, Any] = {}
    replicated = router.replicas > 1
    lost = router.transport.lost_peers()
    for server in [s for s in router.servers if not (replicated and s in lost)]:
        try:
            handle, _ = router.request(server, {"op": "rejoin"})
            # (not router.wait: a replicated wait fences restarted servers, which needs this worker's clock)
            answer = handle.wait(router.timeout)
        except PeerLostError as exc:
            if replicated:  # a dead one fails over, as for any request
                router.lost(exc, server)
                continue
            router.closed = True
            raise WorkDoneError(
                f"worker {worker}: a parameter server is gone ({exc}); servers shut down once every worker has "
                "left, so the process this one replaces had finished its work"
            ) from None
        if answer.meta.get(CATCHING_UP) is True and replicated:
            router.must_fence.add(server)  # restarted, it waits for every worker's fence: this one's too
            continue
        if answer.meta.get("error") is not None:
            raise PSRequestError(f"worker {worker}: rejoin rejected: {answer.meta['error']}")
        answers[server] = answer.meta
        if answer.meta.get("restarted") is True and replicated:
            router.must_fence.add(server)  # caught up before this process connected: fenced at once, so that it
            # is the last owner of its chunks here as on the other workers
    if not answers:
        router.closed = True
        raise WorkDoneError(f"worker {worker}: every parameter server is gone: the work was done")
    if any(meta.get("left") for meta in answers.values()):
        router.closed = True
        raise WorkDoneError(
            f"worker {worker}: the process this one replaces had finished its work and left the servers"
        )
    counted = {s: int(meta.get("clock", 0)) for s, meta in answers.items()}
    router.resume_numbering(max(int(meta.get("incarnation", 0)) for meta in answers.values()) << INCARNATION_BITS)
    clock = min(counted.values()) if staleness == 0 else max(counted.values())
    for server, number in counted.items():
        for missed in range(number + 1, clock + 1):
            router.transport.isend(server, REQUEST_TAG, (), {"op": "clock", "clock": missed, "id": -1})
    router.clock = clock
    return clock
