"""One rank of ``paratrain train --strategy pipeline:SCHEDULE``: one stage of one pipeline, under ``paratrain launch``.

The job has K stages x R replicas = N workers; worker ``r * K + s`` is stage s of pipeline r
(:class:`paratrain.torch.pipeline.Pipe`). Every pipeline trains on its own shard of the training set (a fresh
permutation each epoch, the same on every rank, cut into R parts), ``--batch-size`` examples per pipeline per
step, cut into ``--microbatches`` micro-batches. Stage 0 reads the inputs, the last stage the targets; nothing
else of the data is needed elsewhere.

Update rule (the same as data parallelism's, so that strategies compare): the loss of a step is the mean
cross-entropy over the R x B examples of the step (every micro-batch's summed loss divided by R x B), summed
over the micro-batches and the replicas, then SGD with momentum. GPipe and 1F1B take one step per mini-batch
(parameters equal to one process training on the R mini-batches together); PipeDream one per micro-batch with
weight stashing, each step 1/M of the mini-batch's gradient.

Each rank records its schedule's spans (forward, backward, optimizer step, the waits for activations and
gradients, the replicas' allreduce) as the run's timeline, and per step its compute time and its idle time (the
rest of the step: pipeline bubble plus communication that compute did not hide). After every epoch, pipeline 0
evaluates the test set through the stages (:meth:`Pipe.predict`), and its last stage, which holds the outputs,
writes the accuracy: that rank is the job's reporting rank.

Under ``--max-restarts`` a stage's death rolls the job back (:mod:`paratrain.recovery.buddy`): every stage keeps
its state at step 0 and every ``--checkpoint-every`` steps, the next stage (a replicated stage's twin) holds its
copy, and after a death every stage restores the newest step all hold and trains on; steps and epochs recorded
before are not recorded again (evaluations run again, as they are collective, and are recorded once).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

import paratrain as pt
from paratrain._exit import exit_with
from paratrain.errors import WorkDoneError
from paratrain.recovery.buddy import BROKEN, BuddyRecovery, RolledBackError, is_replacement
from paratrain.recovery.reliable import Checkpoint
from paratrain.runtime.context import reform
from paratrain.strategy import parse_strategy
from paratrain.train.data import load_dataset
from paratrain.train.job import PROBE_EXAMPLES, TrainJob, epoch_steps, run_dir_of, worker_job
from paratrain.train.models import build_model
from paratrain.train.record import Recorder, rank_records
from paratrain.train.worker import epoch_order, record_epoch

_T = TypeVar("_T")

__all__ = ["flat_layers", "main"]


def flat_layers(model: Any) -> list[Any]:
    """The model as one list of layers: nested ``nn.Sequential`` containers opened up (same modules, same
    parameters), so that the pipeline can cut between any two of them."""
    from torch import nn

    if isinstance(model, nn.Sequential):
        return [layer for child in model for layer in flat_layers(child)]
    return [model]


def _evaluate(pipe: Any, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> tuple[float, float] | None:
    """Test accuracy and mean loss through the stages of ``pipe`` (its last stage returns them; None elsewhere)."""
    import torch

    from paratrain.train.tasks import score

    correct, loss_sum, count = 0, 0.0, 0
    for start in range(0, len(y), batch):
        xb = torch.from_numpy(x[start : start + batch]) if pipe.is_first else None
        out = pipe.predict(xb)
        if out is not None:
            c, s, n = score(out, torch.from_numpy(y[start : start + batch]))
            correct, loss_sum, count = correct + c, loss_sum + s, count + n
    return (correct / count, loss_sum / count) if pipe.is_last else None


def _build_pipe(
    job: TrainJob, data: Any, layers: list[Any], spans: list[tuple[str, str, float, float]], *, rejoin: bool
) -> Any:
    """This rank's stage of the job's pipeline (its trace spans go to ``spans``); the loss is the mean over the
    step's targets across every pipeline replica, as data parallelism takes it. ``rejoin``: this process replaces
    a dead stage (it takes the balance the others hold)."""
    import torch

    from paratrain.torch.pipeline import Pipe
    from paratrain.train import tasks

    global_batch = job.replicas * job.batch_size
    per_target = int(np.prod(data.y_train.shape[1:], dtype=np.int64))  # 1 per image, T per text window

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        summed: torch.Tensor = tasks.loss(out, y, reduction="sum")
        return summed.div(global_batch * per_target)

    balance: list[int] | str = "auto" if job.balance == "auto" else [int(b) for b in job.balance.split(",")]
    return Pipe(
        layers,
        balance=balance,
        microbatches=job.microbatches,
        schedule=str(parse_strategy(job.strategy).options["schedule"]),
        optimizer=lambda params: torch.optim.SGD(params, lr=job.lr, momentum=0.9),
        loss_fn=loss_fn,
        sample=torch.from_numpy(data.x_train[: max(1, job.batch_size // job.microbatches)]),
        checkpoint=job.checkpoint,
        replicas=job.replicas,
        trace=lambda name, category, t0, t1: spans.append((name, category, t0, t1)),
        rejoin=rejoin,
    )


def _steps_per_epoch(job: TrainJob, examples: int) -> int:
    """Steps of an epoch: a pipeline replica's share in batches, at most ``--steps-per-epoch``."""
    steps = epoch_steps(job, examples // job.replicas, "a pipeline")
    if job.batch_size < job.microbatches:
        raise SystemExit(f"--batch-size {job.batch_size} cannot be cut into {job.microbatches} micro-batches; raise it")
    return steps


@dataclasses.dataclass
class _Stage:
    """A rank's stage and what it trains with; ``recovery`` under ``--max-restarts`` (checkpoints kept by a buddy
    stage; a death rolls the job back: :mod:`paratrain.recovery.buddy`)."""

    job: TrainJob
    data: Any
    pipe: Any
    rec: Recorder
    spans: list[tuple[str, str, float, float]]
    recovery: BuddyRecovery | None
    steps: int  # per epoch
    quiet: bool
    #: each step's loss on this rank (0 where it has none), as trained: a rollback's epoch loss is their sum
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    #: this rank's final records are written (by this process or its predecessor): never twice
    finalized: bool = False

    def guarded(self, call: Callable[[], _T]) -> _T:
        """``call()``; a death it meets rolls the job back (:class:`RolledBackError`) where stages restart."""
        return call() if self.recovery is None else self.recovery.guarded(call)

    def epoch_loss(self, step: int) -> float:
        """The summed loss of this epoch's steps up to ``step``, added in order as training adds them."""
        total = 0.0
        for s in range(step - (step - 1) % self.steps, step + 1) if step else ():
            total += self.losses.get(s, 0.0)
        return total

    def replaying(self, step: int) -> bool:
        """Whether step ``step + 1`` was run and recorded before a rollback (by this rank or its predecessor)."""
        return self.recovery is not None and self.recovery.replaying_at(step)


def _evaluate_epoch(
    stage: _Stage, *, epoch: int, step: int, train_loss: float, evaluating: float, recording: bool
) -> float:
    """Pipeline 0's test accuracy and loss, recorded by its last stage (which prints the epoch's line) if
    ``recording`` (not when it runs again after a rollback); returns the seconds spent evaluating so far."""
    pipe, data, rec = stage.pipe, stage.data, stage.rec
    t4 = time.time()
    scored = stage.guarded(lambda: _evaluate(pipe, data.x_test, data.y_test))
    rec.add_span("evaluate", "eval", t4, time.time())
    eval_before, evaluating = evaluating, evaluating + time.time() - t4
    if scored is None or not recording:
        return evaluating
    accuracy, test_loss = scored
    times = {"eval_s": evaluating - eval_before, "eval_before_s": eval_before}
    scores = {"train_loss": train_loss, "test_accuracy": accuracy, "test_loss": test_loss}
    record_epoch(rec, stage.job, epoch, step, scores | times, printing=pipe.is_last and not stage.quiet)
    return evaluating


def _probe(stage: _Stage, step: int, evaluating: float) -> float:
    """``--eval-every``: pipeline 0's accuracy on the first test examples, recorded by its last stage unless the
    step is run again after a rollback; returns the seconds spent evaluating so far."""
    pipe, data = stage.pipe, stage.data
    t5 = time.time()
    probe = stage.guarded(lambda: _evaluate(pipe, data.x_test[:PROBE_EXAMPLES], data.y_test[:PROBE_EXAMPLES]))
    spent = time.time() - t5
    if not stage.replaying(step - 1):
        stage.rec.add_span("probe accuracy", "eval", t5, t5 + spent)
        if probe is not None:
            stage.rec.log(kind="probe", step=step, test_accuracy=probe[0], eval_s=spent, eval_before_s=evaluating)
    return evaluating + spent


def _train_step(stage: _Stage, step: int, order: Any) -> float | None:
    """Step ``step + 1`` (this pipeline's batch of position ``step % steps`` in ``order``) trained and, unless
    it runs again after a rollback, recorded; returns this pipeline's mean loss per target on its last stage."""
    import torch

    job, data, pipe, rec, spans = stage.job, stage.data, stage.pipe, stage.rec, stage.spans
    per_replica, batch, i = len(data.y_train) // job.replicas, job.batch_size, step % stage.steps
    mine = order[pipe.replica * per_replica : (pipe.replica + 1) * per_replica]
    idx = np.sort(mine[i * batch : (i + 1) * batch])
    xb = torch.from_numpy(data.x_train[idx]) if pipe.is_first else None
    yb = torch.from_numpy(data.y_train[idx]) if pipe.is_last else None
    spans.clear()
    t0 = time.time()
    total = stage.guarded(lambda: pipe.step(xb, yb))
    t1 = time.time()
    loss = None if total is None else total * job.replicas  # this pipeline's mean loss per target
    if stage.replaying(step):
        return loss
    for name, category, start, end in spans:
        rec.add_span(name, category, start, end, step=step + 1)
    compute = sum(end - start for _, category, start, end in spans if category == "compute")
    rec.log(
        kind="step",
        epoch=step // stage.steps + 1,
        step=step + 1,
        loss=loss,
        samples=batch if pipe.is_first else 0,
        compute_s=compute,
        wait_s=max(0.0, (t1 - t0) - compute),
        stage=pipe.stage_index,
        bytes_sent=pipe.context.transport.stats.bytes_sent,
        allreduce_bytes=pipe.stage_group.collectives.allreduce_bytes if pipe.stage_group else 0,
    )
    return loss


def _restore(pipe: Any, ckpt: Checkpoint) -> int:
    """The stage's state at checkpoint ``ckpt`` restored; returns its step."""
    from paratrain.torch.resilient import restore_training_state

    restore_training_state(pipe.module, pipe.optimizer, ckpt)
    step = int(ckpt.meta["step"])
    pipe.rewind(step, int(ckpt.meta.get("version", 0)))
    return step


def _begin(stage: _Stage, world_size: int) -> tuple[int, float, set[int]]:
    """Where this process starts (step, seconds spent evaluating) and the epochs whose evaluation is recorded
    already: a replacement goes on from the state it received and reads what its predecessor recorded (its losses:
    a copy from a replicated stage's twin holds the same weights, not the same pipeline's losses)."""
    job, pipe, recovery = stage.job, stage.pipe, stage.recovery
    loaded = recovery.load_checkpoint() if recovery is not None else None
    step = _restore(pipe, loaded) if loaded is not None else 0
    if recovery is not None and recovery.restarted:
        records = rank_records(run_dir_of(job), pipe.context.rank)
        stage.losses.update({int(r["step"]): float(r["loss"] or 0.0) for r in records if r.get("kind") == "step"})
        recovery.replay_until = max(stage.losses, default=0)
        evals = [r for r in records if r.get("kind") in ("eval", "probe")]
        evaluating = max((float(r["eval_before_s"]) + float(r["eval_s"]) for r in evals), default=0.0)
        stage.finalized = any(r.get("kind") == "final" for r in records)
        stage.rec.log(kind="rejoined", step=step)
        return step, evaluating, {int(r["epoch"]) for r in records if r.get("kind") == "eval"}
    stage.rec.log(
        kind="start",
        epochs=job.epochs,
        steps_per_epoch=stage.steps,
        world_size=world_size,
        strategy=job.strategy,
        reports=pipe.replica == 0 and pipe.is_last,
        stage=pipe.stage_index,
        replica=pipe.replica,
        stages=pipe.num_stages,
        replicas=job.replicas,
        microbatches=job.microbatches,
        balance=pipe.balance,
        layers=[type(layer).__name__ for layer in pipe.module],
    )
    return step, 0.0, set()


def _setup(job: TrainJob, quiet: bool) -> _Stage:
    """The data, this rank's stage, the job joined, and (``--max-restarts``) its recovery: a replacement meets
    the others and receives its state here."""
    import torch

    from paratrain.torch.resilient import training_state

    # everything that does not depend on the rank comes before init(): a warm spare has it done when it takes over
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    torch.manual_seed(job.seed)
    data = load_dataset(job.dataset, data_dir=job.data_dir)
    layers = flat_layers(build_model(job.model, side=data.side, classes=data.classes))
    ctx = pt.init()
    spans: list[tuple[str, str, float, float]] = []
    met_again = 0  # deaths while the stages met: the job re-formed before any state existed
    while True:
        try:
            pipe = _build_pipe(job, data, layers, spans, rejoin=is_replacement(ctx))
            break
        except BROKEN:
            if not ctx.settings.resilient or met_again == ctx.settings.max_restarts:
                raise
        ctx, met_again = reform(ctx), met_again + 1
    recovery = None
    if ctx.settings.resilient:
        stages = pipe.num_stages  # a replicated stage's copies hold one state: each is the other's checkpoint
        twin = (lambda rank, n: (rank + stages) % n) if job.replicas > 1 else None
        state = pipe.module, pipe.optimizer
        recovery = BuddyRecovery(
            lambda: training_state(*state), ctx, twin=twin, meeting=[pipe.reopen], met_again=met_again > 0
        )
    steps = _steps_per_epoch(job, len(data.y_train))
    return _Stage(job, data, pipe, Recorder(run_dir_of(job), rank=ctx.rank), spans, recovery, steps, quiet)


def main(argv: list[str] | None = None) -> None:
    """Trains this rank's stage and records everything in the job's run directory."""
    from paratrain.torch.resilient import parameters_digest, training_state

    job, quiet = worker_job(argv, __doc__)
    try:
        stage = _setup(job, quiet)
    except WorkDoneError as exc:  # killed after the others' last collective: its work was done, the results stand
        print(f"{exc}; nothing left to do", file=sys.stderr)
        pt.shutdown()
        return
    pipe, rec, recovery, steps = stage.pipe, stage.rec, stage.recovery, stage.steps
    step, evaluating, evaluated = _begin(stage, pipe.context.world_size)
    seen_recoveries = 0
    while True:
        if recovery is not None:
            for done in recovery.recoveries[seen_recoveries:]:
                rec.log(kind="recovery", step=step, **dataclasses.asdict(done))
            seen_recoveries = len(recovery.recoveries)
        try:
            if step == job.epochs * steps:  # every stage is done before any leaves: a late death rolls back too
                if not stage.finalized:  # before the barrier: a rank past it has nothing left to write
                    rec.log(kind="final", step=step, parameters_sha256=parameters_digest(pipe.module))
                    rec.log(kind="memory", stage=pipe.stage_index, peak_held_bytes=pipe.peak_held_bytes)
                    stage.finalized = True
                stage.guarded(pipe.context.barrier)
                break
            loss = _train_step(stage, step, epoch_order(job, len(stage.data.y_train), step // steps))
            step += 1
            stage.losses[step] = loss or 0.0
            if recovery is not None and step % job.checkpoint_every == 0:
                meta = {"step": step, "version": pipe.version}
                recovery.checkpoint(training_state(pipe.module, pipe.optimizer), meta)
            if job.eval_every > 0 and step % job.eval_every == 0 and pipe.replica == 0:
                evaluating = _probe(stage, step, evaluating)
            if step % steps == 0 and pipe.replica == 0:  # (again after a rollback: it is collective; recorded once)
                epoch = step // steps
                evaluating = _evaluate_epoch(
                    stage, epoch=epoch - 1, step=step, train_loss=stage.epoch_loss(step) / steps, evaluating=evaluating,
                    recording=epoch not in evaluated,
                )  # fmt: skip
                evaluated.add(epoch)
        except RolledBackError as exc:
            assert recovery is not None
            recovery.replay_until = max(recovery.replay_until, step)
            rec.log(kind="rollback", step=int(exc.checkpoint.meta["step"]), from_step=step)
            step = _restore(pipe, exc.checkpoint)  # (the seconds spent evaluating go on counting)
    rec.close()
    pipe.close()
    pt.shutdown()


if __name__ == "__main__":
    exit_with(main)
