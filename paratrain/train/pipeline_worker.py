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
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import paratrain as pt
from paratrain._exit import exit_with
from paratrain.strategy import parse_strategy
from paratrain.train.data import load_dataset
from paratrain.train.job import PROBE_EXAMPLES, TrainJob, epoch_steps, run_dir_of, worker_job
from paratrain.train.models import build_model
from paratrain.train.record import Recorder
from paratrain.train.worker import record_epoch

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


def _build_pipe(job: TrainJob, data: Any, spans: list[tuple[str, str, float, float]]) -> Any:
    """This rank's stage of the job's pipeline (its trace spans go to ``spans``); the loss is the mean over the
    step's targets across every pipeline replica, as data parallelism takes it."""
    import torch

    from paratrain.torch.pipeline import Pipe
    from paratrain.train import tasks

    layers = flat_layers(build_model(job.model, side=data.side, classes=data.classes))
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
    )


def _steps_per_epoch(job: TrainJob, examples: int) -> int:
    """Steps of an epoch: a pipeline replica's share in batches, at most ``--steps-per-epoch``."""
    steps = epoch_steps(job, examples // job.replicas, "a pipeline")
    if job.batch_size < job.microbatches:
        raise SystemExit(f"--batch-size {job.batch_size} cannot be cut into {job.microbatches} micro-batches; raise it")
    return steps


def _evaluate_epoch(
    pipe: Any,
    data: Any,
    job: TrainJob,
    rec: Recorder,
    *,
    epoch: int,
    step: int,
    train_loss: float,
    evaluating: float,
    quiet: bool,
) -> float:
    """Pipeline 0's test accuracy and loss, recorded by its last stage (which prints the epoch's line); returns
    the seconds spent evaluating so far."""
    t4 = time.time()
    scored = _evaluate(pipe, data.x_test, data.y_test)
    rec.add_span("evaluate", "eval", t4, time.time())
    eval_before, evaluating = evaluating, evaluating + time.time() - t4
    if scored is None:
        return evaluating
    accuracy, test_loss = scored
    times = {"eval_s": evaluating - eval_before, "eval_before_s": eval_before}
    scores = {"train_loss": train_loss, "test_accuracy": accuracy, "test_loss": test_loss}
    record_epoch(rec, job, epoch, step, scores | times, printing=pipe.is_last and not quiet)
    return evaluating


def main(argv: list[str] | None = None) -> None:
    """Trains this rank's stage and records everything in the job's run directory."""
    job, quiet = worker_job(argv, __doc__)

    import torch

    ctx = pt.init()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    torch.manual_seed(job.seed)
    data = load_dataset(job.dataset, data_dir=job.data_dir)
    replicas, microbatches, batch = job.replicas, job.microbatches, job.batch_size
    rec = Recorder(run_dir_of(job), rank=ctx.rank)
    spans: list[tuple[str, str, float, float]] = []
    pipe = _build_pipe(job, data, spans)
    stages = pipe.num_stages
    reporting = pipe.replica == 0 and pipe.is_last
    per_replica = len(data.y_train) // replicas
    steps = _steps_per_epoch(job, len(data.y_train))
    rec.log(
        kind="start",
        epochs=job.epochs,
        steps_per_epoch=steps,
        world_size=ctx.world_size,
        strategy=job.strategy,
        reports=reporting,
        stage=pipe.stage_index,
        replica=pipe.replica,
        stages=stages,
        replicas=replicas,
        microbatches=microbatches,
        balance=pipe.balance,
        layers=[type(layer).__name__ for layer in pipe.module],
    )
    step = 0
    evaluating = 0.0
    for epoch in range(job.epochs):
        order = np.random.default_rng(job.seed * 1_000_003 + epoch).permutation(len(data.y_train))
        mine = order[pipe.replica * per_replica : (pipe.replica + 1) * per_replica]
        epoch_loss = 0.0
        for i in range(steps):
            idx = np.sort(mine[i * batch : (i + 1) * batch])
            xb = torch.from_numpy(data.x_train[idx]) if pipe.is_first else None
            yb = torch.from_numpy(data.y_train[idx]) if pipe.is_last else None
            spans.clear()
            t0 = time.time()
            total = pipe.step(xb, yb)
            t1 = time.time()
            step += 1
            for name, category, start, end in spans:
                rec.add_span(name, category, start, end, step=step)
            compute = sum(end - start for _, category, start, end in spans if category == "compute")
            loss = None if total is None else total * replicas  # this pipeline's mean loss per target
            if loss is not None:
                epoch_loss += loss
            rec.log(
                kind="step",
                epoch=epoch + 1,
                step=step,
                loss=loss,
                samples=batch if pipe.is_first else 0,
                compute_s=compute,
                wait_s=max(0.0, (t1 - t0) - compute),
                stage=pipe.stage_index,
                bytes_sent=ctx.transport.stats.bytes_sent,
                allreduce_bytes=pipe.stage_group.collectives.allreduce_bytes if pipe.stage_group else 0,
            )
            if job.eval_every > 0 and step % job.eval_every == 0 and pipe.replica == 0:
                t5 = time.time()
                probe = _evaluate(pipe, data.x_test[:PROBE_EXAMPLES], data.y_test[:PROBE_EXAMPLES])
                spent = time.time() - t5
                rec.add_span("probe accuracy", "eval", t5, t5 + spent)
                if probe is not None:
                    rec.log(kind="probe", step=step, test_accuracy=probe[0], eval_s=spent, eval_before_s=evaluating)
                evaluating += spent
        if pipe.replica != 0:
            continue
        evaluating = _evaluate_epoch(
            pipe,
            data,
            job,
            rec,
            epoch=epoch,
            step=step,
            train_loss=epoch_loss / steps,
            evaluating=evaluating,
            quiet=quiet,
        )
    rec.log(kind="memory", stage=pipe.stage_index, peak_held_bytes=pipe.peak_held_bytes)
    rec.close()
    pt.shutdown()


if __name__ == "__main__":
    exit_with(main)
