"""Reliable collectives with in-memory checkpoints: a failed rank restarts and catches up; nobody rolls back.

Rabit's model (Chen et al., "Rabit: a reliable allreduce and broadcast interface"), for data-parallel training
where every rank holds the same model. The program is a sequence of *reliable operations* (allreduce, broadcast
and allgather), numbered 0, 1, 2... alike on every rank, and now and then a :meth:`Reliable.checkpoint` of its
state:

    rel = Reliable(ctx)
    ckpt = rel.load_checkpoint()         # None on a fresh start; a restarted rank gets the newest from a peer
    start = 0 if ckpt is None else restore(ckpt)
    for step in range(start, steps):
        grad = rel.allreduce(local_gradient(step), op="mean")
        update(grad)
        if step % 10 == 9:
            rel.checkpoint(state(), meta={"step": step + 1})

The update rule is the program's own; what this module guarantees is that every rank sees, for operation n,
the bits the fault-free run would have seen:

- a checkpoint is a copy of the state in this rank's memory; every rank holds the same one (the model is
  replicated by data parallelism), so it costs no communication and survives any single failure. Each rank also
  keeps the results of the operations since one before its checkpoint;
- when a peer crashes (``paratrain launch --max-restarts`` restarts it), the operation in progress fails on every
  survivor (a resilient transport breaks every receive). The survivors :func:`~paratrain.runtime.context.reform`
  the job with the replacement, all report what they hold, and run the same :func:`~.plan.plan_recovery`: the
  replacement receives the newest checkpoint and the results since it, and a survivor one operation behind
  receives that one result. Then the interrupted operation runs again, live, with the same inputs;
- the replacement's program restarts from the checkpoint and *replays*: each reliable operation up to the
  frontier returns the received result without communicating, so its state evolves exactly as the others' did.

Determinism is the program's part: the same inputs in the same order on every run (data order a function of the
step, no unseeded randomness). A replayed operation whose input shape differs from the recorded result's is
reported as a :class:`~.plan.RecoveryError` rather than silently diverging.

With ``checkpoint_dir``, rank 0 also writes each checkpoint to ``<dir>/checkpoint.npz`` (atomically: a crash leaves
the previous one), and a job started afresh resumes from it: the answer when every rank died at once, which no
memory survives. Every rank must see the same directory (one host, or a shared filesystem); they check that
they read the same version. The file holds arrays (loaded without pickle) and the meta as JSON.

Unlike Rabit, the survivors do not block a restart on a fixed schedule of their own: they re-form as soon as
the replacement registers, and a warm spare makes that a fraction of a second (see ``benchmarks/recovery``).

**Elastic jobs** (``paratrain launch --min-workers``, :attr:`~paratrain.config.Settings.elastic`) may also change
size. When a worker dies with no warm replacement, the launcher drops it and the survivors re-form without it
(renumbered, a smaller ring); its replacement, started cold, *joins* later: at the next :meth:`Reliable.checkpoint`
every rank agrees (one small allreduce, made only in elastic jobs) whether someone waits to join, and if so they
re-form with it and it receives the checkpoint just taken. An operation whose inputs came from every rank (a
gradient sum) cannot simply run again in a smaller job: the dead rank's part would be missing. So when the
members change during such an operation, it raises :class:`RegroupedError` after the recovery, on every rank that
was in it; the program recomputes its inputs for the new job (its share of the data) and calls it again, with
the same operation number. Operations marked ``whole=False`` (where any subset of ranks gives an acceptable
result, as the join check's maximum) run again at once instead.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from paratrain.errors import PeerLostError, TransportClosedError
from paratrain.launch.kills import checkpoint_kill_point
from paratrain.launch.restarts import read_join_round
from paratrain.recovery.plan import RankState, RecoveryError, RecoveryPlan, plan_recovery
from paratrain.runtime.context import Context, current, reform

__all__ = ["Checkpoint", "Recovery", "RegroupedError", "Reliable", "load_checkpoint_file", "save_checkpoint"]

log = logging.getLogger("paratrain.recovery")

Array = npt.NDArray[Any]
#: What breaks an operation when a peer crashes; anything else (a timeout, a bad argument) is not recovered.
_BROKEN = (PeerLostError, TransportClosedError)
#: The reliable operations (a result every rank holds alike).
_KINDS = ("allreduce", "broadcast", "allgather")


class RegroupedError(RuntimeError):
    """The job's members changed during a reliable operation that needs every rank's input (elastic jobs).

    The job has re-formed (read :attr:`Reliable.ctx` for the new rank and size); recompute this operation's
    input for the new job and make the same call again.

    Attributes:
        seq: the operation to call again.
        members: the member ids of the new job, in rank order.
    """

    def __init__(self, seq: int, members: list[int]) -> None:
        super().__init__(
            f"reliable operation {seq}: the job re-formed with members {members}; recompute its input and call again"
        )
        self.seq = seq
        self.members = members


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A state saved by :meth:`Reliable.checkpoint`.

    Attributes:
        version: 1 for the first checkpoint of the job, then 2, 3...
        seq: reliable operations completed when it was taken (where a restarted rank resumes).
        arrays: the state's arrays, by name (copies, owned by the checkpoint).
        meta: small values saved with it (e.g. the step).
    """

    version: int
    seq: int
    arrays: Mapping[str, Array]
    meta: Mapping[str, int | float | str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Recovery:
    """One recovery as this rank lived it (times are ``time.time()``, seconds).

    Attributes:
        failed_at: when the broken operation was noticed (a survivor), the process started (a replacement), or
            the checkpoint that admits a joiner began (a member of an elastic job).
        reformed_at: when the job had met again (the rendezvous round completed).
        done_at: when this rank had everything it needed (checkpoint and results received).
        frontier: the operation everyone ran live next.
        replayed: results received to replay (a replacement) or to skip one behind (a survivor).
        bytes_received: bytes of checkpoint and results received.
        restarted: this rank is the replacement (or, in an elastic job, a joiner).
        members: the member ids of the job as it re-formed, in rank order.
        world_size: the size of the job as it re-formed.
    """

    failed_at: float
    reformed_at: float
    done_at: float
    frontier: int
    replayed: int
    bytes_received: int
    restarted: bool
    members: tuple[int, ...] = ()
    world_size: int = 0


def meta_value(value: object) -> int | float | str:
    """``value`` as a checkpoint's meta holds it (int, float or str), or TypeError."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"checkpoint meta values must be int, float or str, got {type(value).__name__}")
    return value


CHECKPOINT_FILE = "checkpoint.npz"
_META_KEY = "__paratrain_checkpoint__"


def save_checkpoint(ckpt: Checkpoint, directory: str | os.PathLike[str]) -> Path:
    """Writes ``ckpt`` to ``<directory>/checkpoint.npz``, replacing the previous one atomically; returns the path."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(ckpt.arrays)
    head = {"version": ckpt.version, "seq": ckpt.seq, "meta": dict(ckpt.meta), "names": names}
    arrays = {f"a{i}": np.asarray(ckpt.arrays[name]) for i, name in enumerate(names)}
    arrays[_META_KEY] = np.frombuffer(json.dumps(head).encode("utf-8"), dtype=np.uint8)
    tmp = folder / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / CHECKPOINT_FILE)
    return folder / CHECKPOINT_FILE


def load_checkpoint_file(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The checkpoint :func:`save_checkpoint` wrote in ``directory``, or None if there is none.

    Raises:
        RecoveryError: the file is not a checkpoint of this format (the message names it).
    """
    path = Path(directory) / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            head = json.loads(bytes(data[_META_KEY]).decode("utf-8"))
            names = [str(n) for n in head["names"]]
            arrays = {name: np.array(data[f"a{i}"]) for i, name in enumerate(names)}
        meta = {str(k): meta_value(v) for k, v in dict(head["meta"]).items()}
        return Checkpoint(int(head["version"]), int(head["seq"]), arrays, meta)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RecoveryError(
            f"{path} is not a paratrain checkpoint ({exc}); remove it or choose another directory"
        ) from None


class Reliable:
    """Reliable allreduce and broadcast with in-memory checkpoints over a context (see the module docstring).

    Create it right after ``paratrain.init()``, before any other collective: in a replacement process the
    constructor is where it catches up with the survivors.

    Args:
        ctx: the context (default: the current one). It is replaced after a failure: read :attr:`ctx`.
        reform: how to meet the others again (tests may substitute it).
        checkpoint_dir: also keep each checkpoint on disk there (rank 0 writes), and resume from it when the job
            starts afresh (see the module docstring).

    Raises:
        RecoveryError: (in a replacement) the survivors do not hold what it needs.
    """

    def __init__(
        self,
        ctx: Context | None = None,
        *,
        reform: Callable[[Context], Context] = reform,
        checkpoint_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.ctx = ctx if ctx is not None else current()
        self._reform = reform
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        #: Reliable operations completed; the number of the next one.
        self.seq = 0
        self._checkpoint: Checkpoint | None = None
        self._cache: dict[int, tuple[str, Array]] = {}
        self._replay: dict[int, tuple[str, Array]] = {}
        self._loaded: Checkpoint | None = None
        #: Every recovery this rank took part in, oldest first.
        self.recoveries: list[Recovery] = []
        #: The member ids of the job, in rank order (they change only in an elastic job).
        self.members: list[int] = list(range(self.ctx.world_size))
        self._regrouped = False  # the last recovery changed the members
        # a restarted process whose job meets for the first time (round 1) took its predecessor's place before
        # anyone ran anything: the others start afresh, and so does it (round 0: no rendezvous that counts)
        if self.ctx.settings.restart_count > 0 and self.ctx.transport.round != 1:
            self._join()
        elif self.checkpoint_dir is not None:
            self._resume_from_disk()

    @property
    def replaying(self) -> bool:
        """True while this rank still replays received results (it is catching up after a restart)."""
        return bool(self._replay)

    def replaying_at(self, step: int) -> bool:
        """Whether the step after ``step`` replays received results (the same as :attr:`replaying`)."""
        return self.replaying

    @property
    def resilient(self) -> bool:
        """True when the launcher restarts failed ranks (otherwise a failure is raised, as without this class)."""
        return self.ctx.settings.resilient

    @property
    def elastic(self) -> bool:
        """True when the job may change size (``--min-workers``): see the module docstring."""
        return self.ctx.settings.elastic

    # -- the program's side --------------------------------------------------------------------------------

    def load_checkpoint(self) -> Checkpoint | None:
        """The checkpoint to resume from: None on a fresh start (or if none was taken before a failure)."""
        return self._loaded

    def checkpoint(self, arrays: Mapping[str, Any], meta: Mapping[str, object] | None = None) -> Checkpoint:
        """Saves ``arrays`` (copied) and ``meta`` as the state to restart from; forgets older results. Local."""
        # an elastic job first agrees whether someone waits to join (then they meet below, after the copy)
        joining = self.elastic and self._join_wanted()
        copies = {str(name): np.array(value, copy=True) for name, value in arrays.items()}
        version = (self._checkpoint.version if self._checkpoint is not None else 0) + 1
        values = {str(k): meta_value(v) for k, v in (meta or {}).items()}
        checkpoint_kill_point(version)  # paratrain launch --kill RANK@checkpoint=V: a death mid-checkpoint
        ckpt = self._checkpoint = Checkpoint(version, self.seq, copies, values)
        # keep one result before the checkpoint: a survivor one operation behind may need it
        for seq in [s for s in self._cache if s < self.seq - 1]:
            del self._cache[seq]
        if self.checkpoint_dir is not None and self.ctx.rank == 0:
            save_checkpoint(ckpt, self.checkpoint_dir)
        if joining:
            log.info("rank %d: admitting a joiner at checkpoint %d", self.ctx.rank, version)
            self._recover(time.time())
            self._regrouped = False  # between operations: nothing to recompute
        return ckpt

    def _join_wanted(self) -> bool:
        """Whether any rank saw a joiner waiting for a round after this job's (a reliable maximum)."""
        wanted = read_join_round(self.ctx.settings.scratch_dir)
        agreed = self.allreduce(np.array([wanted], dtype=np.int64), op="max", whole=False)
        return int(agreed[0]) > self.ctx.transport.round

    def allreduce(self, x: Any, op: str = "sum", *, whole: bool = True) -> Array:
        """The reliable ``allreduce`` of ``x`` (not modified); returns a new array, the same bits on every rank.

        Args:
            whole: the result needs every rank's input. In an elastic job whose members change during the call
                it then raises :class:`RegroupedError` (recompute ``x`` for the new job and call again); with False
                it runs again at once among the new members.
        """
        array = np.asarray(x)
        return self._operation("allreduce", array, lambda ctx: np.asarray(ctx.allreduce(array, op=op)), whole)

    def broadcast(self, x: Any, root: int = 0) -> Array:
        """The reliable ``broadcast`` of ``root``'s ``x`` (not modified); returns a new array. In an elastic job
        whose members change during it, the new job's rank ``root`` sends."""
        array = np.asarray(x)
        return self._operation(
            "broadcast", array, lambda ctx: np.asarray(ctx.broadcast(array.copy(), root=root)), False
        )

    def allgather(self, x: Any) -> Array:
        """The reliable ``allgather`` of every rank's ``x`` (not modified): their concatenation along axis 0 in rank
        order, a new array, the same bits on every rank (first dimensions may differ between ranks). It needs
        every rank's input: in an elastic job whose members change during it, it raises :class:`RegroupedError`."""
        array = np.asarray(x)
        return self._operation("allgather", array, lambda ctx: np.asarray(ctx.allgather(array)), True)

    # -- operations ----------------------------------------------------------------------------------------

    def _operation(self, kind: str, array: Array, run: Callable[[Context], Array], whole: bool) -> Array:
        seq = self.seq
        replayed = self._replay.pop(seq, None)
        while replayed is None:
            try:
                result = run(self.ctx)
                break
            except _BROKEN as exc:
                if not self.resilient:
                    raise
                failed_at, why = time.time(), str(exc)
            # recover outside the handler: the exception's traceback holds the broken collective's frames, whose
            # views of the shared-memory segment would keep it mapped (and its close would fall back to a full
            # garbage collection, 170 ms with torch loaded)
            log.warning("rank %d: reliable %s #%d broken (%s); recovering", self.ctx.rank, kind, seq, why)
            self._recover(failed_at)
            replayed = self._replay.pop(seq, None)
            if replayed is None and whole and self._regrouped:
                self._regrouped = False
                raise RegroupedError(seq, list(self.members))
        if replayed is not None:
            recorded_kind, result = replayed
            # an allgather's result is the ranks' rows together: only its rows' shape is this rank's
            shaped = result.shape[1:] == array.shape[1:] if kind == "allgather" else result.shape == array.shape
            if recorded_kind != kind or not shaped or result.dtype != array.dtype:
                raise RecoveryError(
                    f"rank {self.ctx.rank}: replaying reliable operation {seq}: the program asks for a {kind} of "
                    f"{array.shape} {array.dtype}, the job ran a {recorded_kind} of {result.shape} {result.dtype}. "
                    "The program must make the same reliable calls in the same order on every run"
                )
        self._cache[seq] = (kind, result)
        self.seq = seq + 1
        return result.copy()

    # -- recovery ------------------------------------------------------------------------------------------

    def _state(self, *, restarted: bool) -> RankState:
        if restarted:
            return RankState.restarted()
        ckpt = self._checkpoint
        cache_lo = min(self._cache, default=self.seq)
        return RankState(self.seq, ckpt.version if ckpt else 0, ckpt.seq if ckpt else 0, cache_lo)

    def _resume_from_disk(self) -> None:
        """A fresh job: every rank loads the newest checkpoint on disk, if any, and resumes at its operation."""
        assert self.checkpoint_dir is not None
        ckpt = load_checkpoint_file(self.checkpoint_dir)
        version = ckpt.version if ckpt is not None else 0
        seen = np.asarray(self.ctx.allgather(np.array([version], dtype=np.int64))).reshape(-1)
        if len(set(seen.tolist())) != 1:
            raise RecoveryError(
                f"rank {self.ctx.rank}: the ranks read different checkpoints in {self.checkpoint_dir} (versions "
                f"{seen.tolist()}); the directory must be the same for every rank (a shared filesystem)"
            )
        if ckpt is not None:
            self._checkpoint = self._loaded = ckpt
            self.seq = ckpt.seq
            log.info("rank %d: resumed from %s (checkpoint %d)", self.ctx.rank, self.checkpoint_dir, version)

    def _join(self) -> None:
        """A replacement's catch-up, at construction: the job has just re-formed around it."""
        started = time.time()
        self._exchange(started, started, restarted=True)

    def _recover(self, failed_at: float) -> None:
        """A survivor's side: re-form (again, if another rank fails meanwhile) and exchange."""
        settings = self.ctx.settings
        limit = settings.max_restarts + 1 + (settings.job_workers if settings.elastic else 0)
        before = list(self.members)  # against the job the broken operation ran in, however many attempts
        for attempt in range(limit):
            self.ctx = self._reform(self.ctx)
            try:
                self._exchange(failed_at, time.time(), restarted=False)
                self._regrouped = self.members != before
                return
            except _BROKEN as exc:
                if attempt + 1 == limit:
                    raise
                log.warning("rank %d: a rank failed during recovery (%s); re-forming again", self.ctx.rank, exc)

    def _exchange(self, failed_at: float, reformed_at: float, *, restarted: bool) -> None:
        ctx = self.ctx
        mine = self._state(restarted=restarted)
        row = [*mine.as_list(), ctx.settings.member_id]
        table = np.asarray(ctx.allgather(np.asarray(row, dtype=np.int64))).reshape(ctx.world_size, 5)
        states = [RankState(*(int(v) for v in r[:4])) for r in table]
        members = [int(r[4]) for r in table]
        self.members = members
        plan = plan_recovery(states)
        tag = ctx.next_collective_tag()
        self._send(ctx, plan, tag)
        received = self._receive(ctx, plan, tag, states)
        if restarted:
            self.seq = plan.start(ctx.rank, states)
        self.recoveries.append(
            Recovery(
                failed_at,
                reformed_at,
                time.time(),
                plan.frontier,
                len(self._replay),
                received,
                restarted,
                tuple(members),
                ctx.world_size,
            )
        )
        log.info(
            "rank %d: recovered (frontier %d, %d results to replay, %d bytes received)",
            ctx.rank,
            plan.frontier,
            len(self._replay),
            received,
        )

    def _send(self, ctx: Context, plan: RecoveryPlan, tag: int) -> None:
        me = ctx.rank
        transport = ctx.workers
        if plan.checkpoint is not None and plan.checkpoint.src == me:
            ckpt = self._checkpoint
            assert ckpt is not None and ckpt.version == plan.checkpoint.version
            names = list(ckpt.arrays)
            meta = {"version": ckpt.version, "seq": ckpt.seq, "names": names, "meta": dict(ckpt.meta)}
            for dst in plan.checkpoint.dst:
                transport.send(dst, tag, [ckpt.arrays[n] for n in names], meta)
        for t in plan.transfers:
            if t.src == me:
                for seq in range(t.lo, t.hi):
                    kind, result = self._cache[seq]
                    transport.send(t.dst, tag, [result], {"seq": seq, "kind": kind})

    def _receive(self, ctx: Context, plan: RecoveryPlan, tag: int, states: list[RankState]) -> int:
        me = ctx.rank
        transport = ctx.workers
        received = 0
        if plan.checkpoint is not None and me in plan.checkpoint.dst:
            msg = transport.recv(plan.checkpoint.src, tag)
            names, meta = msg.meta.get("names"), msg.meta.get("meta")
            if not isinstance(names, list) or len(names) != len(msg.arrays) or not isinstance(meta, dict):
                raise RecoveryError(f"rank {me}: a malformed checkpoint came from rank {plan.checkpoint.src}")
            arrays = {str(n): np.array(a, copy=True) for n, a in zip(names, msg.arrays, strict=True)}
            values = {str(k): meta_value(v) for k, v in meta.items()}
            self._checkpoint = Checkpoint(plan.checkpoint.version, plan.checkpoint.seq, arrays, values)
            self._loaded = self._checkpoint
            received += msg.nbytes
        for t in plan.transfers:
            if t.dst != me:
                continue
            for seq in range(t.lo, t.hi):
                msg = transport.recv(t.src, tag)
                kind = msg.meta.get("kind")
                if msg.meta.get("seq") != seq or kind not in _KINDS or len(msg.arrays) != 1:
                    raise RecoveryError(f"rank {me}: expected the result of operation {seq} from rank {t.src}")
                self._replay[seq] = (str(kind), np.array(msg.arrays[0], copy=True))
                received += msg.nbytes
        return received
