"""In-memory checkpoints for ranks whose states differ (gossip workers, pipeline stages), kept by a buddy; a death
rolls the job back.

What the training loop of gossip workers or pipeline stages uses under ``paratrain launch --max-restarts``, in
place of :class:`~.reliable.Reliable` (whose ranks all hold one state). Each rank checkpoints its own state at the same
steps (step 0 when created, then every ``K`` steps: :meth:`BuddyRecovery.checkpoint`), keeps its two newest and
sends a copy to its buddy (:func:`~.rollback.buddy_of`, the next rank), which keeps its ward's two newest. When a
rank dies, every survivor's next receive breaks (a resilient transport); the survivors re-form the job with the
replacement, report what they hold, and all compute :func:`~.rollback.plan_rollback`: the newest step held by
everyone. The replacement receives its copy from its buddy, everyone restores that step's state and trains on
from it (the survivors get :class:`RolledBackError` with their checkpoint), and the states at that step are
checkpointed again at once, so the next death finds every copy in place. Training is deterministic, so the job
computes again exactly what it computed: the final models are the fault-free run's, bit for bit.

Step 0's state is the seeded initial model, which a replacement builds itself: a death before the first
checkpoint's copy arrived rolls back to step 0 without a transfer.

Pipelines use the same: a stage's state (its layers' weights and optimizer state, between mini-batches) is kept by
the next stage; the copies of a replicated stage hold one state, so each is the other's copy (``twin=``) and no
copy travels until a replacement needs one. Whatever a replacement's constructors run collectively before this
object exists (a pipeline's groups), the survivors run in :attr:`BuddyRecovery.meeting` as they re-form.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from paratrain.errors import PeerLostError, TransportClosedError
from paratrain.recovery.plan import RecoveryError
from paratrain.recovery.reliable import Checkpoint, Recovery, meta_value
from paratrain.recovery.rollback import KEPT, RollbackState, buddy_of, plan_rollback
from paratrain.runtime.context import Context, current, reform

__all__ = ["BuddyRecovery", "RolledBackError", "is_replacement"]

log = logging.getLogger("paratrain.recovery")

_T = TypeVar("_T")

#: What breaks a receive when a peer crashes; anything else (a timeout, a bad argument) is not recovered.
BROKEN = (PeerLostError, TransportClosedError)


def is_replacement(ctx: Context) -> bool:
    """Whether this process replaces a dead rank of a job under ``paratrain launch --max-restarts`` (it meets the
    survivors of a re-formed job, which tell it what it lost)."""
    return ctx.settings.restart_count > 0 and ctx.transport.round != 1


class RolledBackError(RuntimeError):
    """A rank died and the job rolled back: restore :attr:`checkpoint` (this rank's state at its ``meta["step"]``)
    and train on from that step. The context is a new one (:attr:`BuddyRecovery.ctx`)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(f"the job rolled back to step {checkpoint.meta.get('step')} after a death")
        self.checkpoint = checkpoint


class BuddyRecovery:
    """A rank's checkpoints, its ward's copies, and the rollback after a death (see the module docstring).

    Create it right after ``paratrain.init()``, before any other communication, with the model and optimizer
    built: in a replacement the constructor is where it meets the survivors and receives its state.

    Args:
        state: the training state as named arrays now (:func:`paratrain.torch.resilient.training_state`).
        ctx: the context (default: the current one). It is replaced after a death: read :attr:`ctx`.
        reform: how to meet the others again (tests may substitute it).
        twin: ``twin(rank, n)``, a rank that always holds the same state as ``rank`` (the copy of a replicated
            pipeline stage): no copies are sent, and a replacement receives its state from its twin. Default:
            states differ, and each rank's copies go to its buddy.
        meeting: the first :attr:`meeting` callbacks (a death met in this constructor already needs them).
        met_again: this rank re-formed the job before creating this object (a death during the program's own
            set-up, before any state existed): it meets the replacement as a survivor does, at step 0.

    Raises:
        RecoveryError: (in a replacement) the survivors do not hold its state.
    """

    def __init__(
        self,
        state: Callable[[], Mapping[str, Any]],
        ctx: Context | None = None,
        *,
        reform: Callable[[Context], Context] = reform,
        twin: Callable[[int, int], int] | None = None,
        meeting: Sequence[Callable[[Context], None]] = (),
        met_again: bool = False,
    ) -> None:
        self.ctx = ctx if ctx is not None else current()
        self._twin = twin
        self._state = state
        self._reform = reform
        self._own: list[Checkpoint] = []  # newest first
        self._ward: list[Checkpoint] = []  # the ward's copies, newest first
        self._loaded: Checkpoint | None = None
        #: Called with the new context after each recovery (the strategy re-opens its exchange there).
        self.reformed: list[Callable[[Context], None]] = []
        #: Called with the new context right after re-forming, before the reports: the collectives a replacement
        #: runs before it creates this object (a pipeline's stages meet again, :meth:`Pipe.reopen`).
        self.meeting: list[Callable[[Context], None]] = list(meeting)
        #: Every recovery this rank took part in, oldest first.
        self.recoveries: list[Recovery] = []
        #: Steps up to here were run (and recorded) before the rollback: a replaying rank records them once.
        self.replay_until = 0
        #: This process replaces a dead rank (it met the survivors in its constructor).
        self.restarted = is_replacement(self.ctx)
        if self.restarted:
            started = time.time()
            self._exchange(started, started, restarted=True)
        else:
            self._keep(self._initial())
            if met_again:  # the replacement is in its constructor's exchange: meet it there
                self._first_exchange()
            elif self._copy_broken():  # a death before anything ran: step 0 again, which is where this rank is
                self._recover(time.time())

    # -- the program's side --------------------------------------------------------------------------------

    def load_checkpoint(self) -> Checkpoint | None:
        """The state a replacement resumes from: None where that is the initial one (step 0)."""
        return self._loaded

    def replaying_at(self, step: int) -> bool:
        """Whether step ``step + 1`` was run before a rollback (recorded already)."""
        return step < self.replay_until

    def checkpoint(self, arrays: Mapping[str, Any], meta: Mapping[str, object]) -> Checkpoint:
        """Keeps ``arrays`` (copied) and ``meta`` (with the ``"step"``) as this rank's state, sends a copy to the
        buddy and takes the ward's of the same step.

        Raises:
            RolledBackError: a rank died meanwhile; the job rolled back (restore the error's checkpoint).
        """
        values = {str(k): meta_value(v) for k, v in meta.items()}
        ckpt = Checkpoint(int(values["step"]), int(values["step"]), _copies(arrays), values)
        self._keep(ckpt)
        if self._copy_broken():
            raise RolledBackError(self._recover(time.time()))
        return ckpt

    def guarded(self, call: Callable[[], _T]) -> _T:
        """``call()`` (any communication of this rank's); a death it meets rolls the job back.

        Raises:
            RolledBackError: the job rolled back (restore the error's checkpoint and train on from its step).
        """
        try:
            return call()
        except BROKEN as exc:
            failed_at = time.time()
            log.warning("%s; rolling back to the newest checkpoint every rank holds", exc)
        # recover outside the handler: the traceback holds the broken call's frames and buffers
        raise RolledBackError(self._recover(failed_at))

    # -- checkpoints ---------------------------------------------------------------------------------------

    def _initial(self) -> Checkpoint:
        return Checkpoint(0, 0, _copies(self._state()), {"step": 0, "epoch_loss": 0.0, "evaluating": 0.0})

    def _keep(self, ckpt: Checkpoint) -> None:
        self._own = [ckpt, *[c for c in self._own if c.version < ckpt.version]][:KEPT]

    def _copy_broken(self) -> bool:
        """Sends the newest own checkpoint to the buddy and receives the ward's of the same step; True if a
        death broke it (recover outside the handler: the traceback would hold the transport's buffers)."""
        try:
            self._copy()
        except BROKEN as exc:
            log.warning("rank %d: checkpoint copy broken (%s); recovering", self.ctx.rank, exc)
            return True
        return False

    def _copy(self) -> None:
        ctx, ckpt = self.ctx, self._own[0]
        n = ctx.world_size
        if self._twin is not None:  # the twin's own checkpoints are this rank's copies, and the other way round
            self._ward = list(self._own)
            return
        tag = ctx.next_collective_tag()
        if n == 1:
            return
        sent = ctx.workers.isend(buddy_of(ctx.rank, n), tag, *_message(ckpt))
        ward = (ctx.rank - 1) % n
        got = _checkpoint_of(ctx.workers.recv(ward, tag, timeout=ctx.settings.timeout), ward, ckpt.version)
        sent.wait(ctx.settings.timeout)
        self._ward = [got, *[c for c in self._ward if c.version < got.version]][:KEPT]

    # -- recovery ------------------------------------------------------------------------------------------

    def _first_exchange(self) -> None:
        """A survivor's exchange with a replacement before any step (see ``met_again``); another death meanwhile
        is recovered as any other."""
        now = time.time()
        try:
            self._exchange(now, now, restarted=False)
            return
        except BROKEN as exc:
            log.warning("rank %d: a rank failed during recovery (%s); re-forming again", self.ctx.rank, exc)
        self._recover(now)

    def _recover(self, failed_at: float) -> Checkpoint:
        settings = self.ctx.settings
        for attempt in range(settings.max_restarts + 1):
            self.ctx = self._reform(self.ctx)
            reformed_at = time.time()
            try:
                for meet in self.meeting:
                    meet(self.ctx)
                return self._exchange(failed_at, reformed_at, restarted=False)
            except BROKEN as exc:
                if attempt == settings.max_restarts:
                    raise
                log.warning("rank %d: a rank failed during recovery (%s); re-forming again", self.ctx.rank, exc)
        raise AssertionError("unreachable")

    def _exchange(self, failed_at: float, reformed_at: float, *, restarted: bool) -> Checkpoint:
        """Everyone's report, the plan, the replacements' copies; then the state of the plan's step is this
        rank's newest checkpoint and copied to the buddy again. Returns that state."""
        ctx = self.ctx
        mine = RollbackState.replacement() if restarted else RollbackState(
            tuple(c.version for c in self._own), tuple(c.version for c in self._ward)
        )  # fmt: skip
        table = np.asarray(ctx.allgather(np.asarray(mine.as_row(), dtype=np.int64))).reshape(ctx.world_size, -1)
        plan = plan_rollback([RollbackState.from_row(row) for row in table.tolist()], self._twin or buddy_of)
        tag = ctx.next_collective_tag()
        received = 0
        for copy in plan.copies:
            if copy.src == ctx.rank:
                ckpt = next(c for c in (self._own if self._twin else self._ward) if c.version == plan.step)
                ctx.workers.send(copy.dst, tag, *_message(ckpt))
            elif copy.dst == ctx.rank:
                msg = ctx.workers.recv(copy.src, tag, timeout=ctx.settings.timeout)
                self._loaded = _checkpoint_of(msg, copy.src, plan.step)
                received += msg.nbytes
        if restarted:
            restored = self._loaded if self._loaded is not None else self._initial()
        else:
            restored = next(c for c in self._own if c.version == plan.step)
        self._own = [restored]
        self._ward = [c for c in self._ward if c.version <= plan.step]
        self._copy()
        for callback in self.reformed:
            callback(ctx)
        self.recoveries.append(
            Recovery(
                failed_at, reformed_at, time.time(), plan.step, 0, received, restarted,
                tuple(range(ctx.world_size)), ctx.world_size,
            )
        )  # fmt: skip
        log.info("rank %d: rolled back to step %d (%d bytes received)", ctx.rank, plan.step, received)
        return restored


def _copies(arrays: Mapping[str, Any]) -> dict[str, npt.NDArray[Any]]:
    return {str(name): np.array(value, copy=True) for name, value in arrays.items()}


def _message(ckpt: Checkpoint) -> tuple[list[npt.NDArray[Any]], dict[str, Any]]:
    """A checkpoint copy as a message's arrays and meta (read back by :func:`_checkpoint_of`)."""
    names = list(ckpt.arrays)
    return [np.asarray(ckpt.arrays[k]) for k in names], {"step": ckpt.version, "names": names, "meta": dict(ckpt.meta)}


def _checkpoint_of(msg: Any, src: int, step: int) -> Checkpoint:
    """The checkpoint copy ``src`` sent for ``step``, checked (arrays only; nothing is unpickled)."""
    names, meta = msg.meta.get("names"), msg.meta.get("meta")
    if (
        not isinstance(names, list)
        or len(names) != len(msg.arrays)
        or not isinstance(meta, dict)
        or msg.meta.get("step") != step
    ):
        raise RecoveryError(f"a malformed checkpoint copy of step {step} came from rank {src}")
    arrays = {str(n): np.array(a, copy=True) for n, a in zip(names, msg.arrays, strict=True)}
    return Checkpoint(step, step, arrays, {str(k): meta_value(v) for k, v in meta.items()})
