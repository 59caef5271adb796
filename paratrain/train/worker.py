"""One rank of ``paratrain train``: ``python -m paratrain.train.worker --job RUN_DIR/job.json`` (under the launcher).

Every worker trains the same model on its shard of the training set (a fresh permutation each epoch, the same
on every rank, cut into equal parts), with the chosen strategy doing the synchronisation. Each step is
recorded as spans (forward and backward are compute; ``step`` is where the strategy waits for communication
that backward did not hide) and a metrics line; each epoch ends with test accuracy on the rank's own model
(and for gossip the last one also on the workers' average model, with their consensus distance).
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
from paratrain.fusion.buckets import DEFAULT_BUCKET_BYTES
from paratrain.recovery import RegroupedError, Reliable
from paratrain.recovery.buddy import BuddyRecovery, RolledBackError
from paratrain.strategy import parse_layer_schemes, parse_strategy
from paratrain.train import stragglers, tasks
from paratrain.train.data import load_dataset
from paratrain.train.job import PROBE_EXAMPLES, TrainJob, epoch_steps, run_dir_of, worker_job
from paratrain.train.models import build_model, check_model_dataset
from paratrain.train.record import Recorder, rank_records
from paratrain.train.shards import step_share

_T = TypeVar("_T")

__all__ = ["epoch_line", "epoch_order", "main", "record_epoch", "worker_device"]


def epoch_line(epoch: int, epochs: int, train_loss: float, accuracy: float, test_loss: float) -> str:
    """The line rank 0 prints after each epoch (``paratrain train`` prints it through its progress bar)."""
    return (
        f"epoch {epoch}/{epochs}: train loss {train_loss:.4f}, test accuracy {accuracy:.4f}, test loss {test_loss:.4f}"
    )


def worker_device(name: str, index: int | None = None) -> Any:
    """The torch device this worker trains on: the CPU, or for ``cuda`` GPU ``index`` (default ``LOCAL_RANK``)
    modulo the GPUs there are (made the current device, as collectives on CUDA tensors and NCCL expect)."""
    import torch

    if name != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device on this host")
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", index % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def consensus_eval(ctx: pt.Context, model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """For gossip, whose workers differ: the workers' average model's accuracy and the consensus distance.

    D-PSGD's guarantees are about the average of the workers' parameters (Lian et al.), which no worker holds;
    one allreduce per evaluation computes it, on a copy, so training itself is not changed. The consensus
    distance is the mean over workers of the squared distance ``|x_i - mean|^2``. Every rank must call it.
    """
    import copy

    import torch

    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mean = ctx.allreduce(params, op="mean")
    distance = float(ctx.allreduce((params - mean).pow(2).sum().reshape(1), op="mean")[0])
    average = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(mean, average.parameters())
    accuracy, _ = tasks.evaluate(average, x, y)
    return {"consensus_accuracy": accuracy, "consensus_distance": distance}


class _Traffic:
    """Bytes sent and allreduced so far, across the contexts a recovering job goes through (each starts at 0)."""

    def __init__(self, ctx: pt.Context) -> None:
        self._ctx = ctx
        self._before = {"bytes_sent": 0, "allreduce_bytes": 0}
        self._last = dict(self._before)  # the old context's counts when last read (it is closed when replaced)

    def update(self, ctx: pt.Context) -> dict[str, int]:
        """The totals, given the context in use now."""
        if ctx is not self._ctx:
            self._before = {k: v + self._last[k] for k, v in self._before.items()}
            self._ctx = ctx
        self._last = {"bytes_sent": ctx.transport.stats.bytes_sent, "allreduce_bytes": ctx.collectives.allreduce_bytes}
        return {k: v + self._before[k] for k, v in self._last.items()}


@dataclasses.dataclass
class _Setup:
    """What a worker trains with, built before its first step."""

    data: Any
    model: Any
    optimizer: Any
    device: Any
    ctx: pt.Context
    reliable: Reliable | BuddyRecovery | None
    dopt: Any
    resumed: Any


def _setup(job: TrainJob) -> _Setup:
    """The data, model and optimizer, the job joined, and the parameters every rank starts from (rank 0's, or the
    checkpoint a restarted or resumed job continues from)."""
    import torch

    import paratrain.torch as ptt
    from paratrain.torch.resilient import reliable_broadcast_parameters, restore_training_state, training_state

    check_model_dataset(job.model, job.dataset)  # before init: a mismatch fails every rank alike, at once

    # everything that does not depend on the rank comes before init(): a warm spare (--max-restarts) has it
    # done when it takes over a failed rank
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    torch.manual_seed(job.seed)
    data = load_dataset(job.dataset, data_dir=job.data_dir)
    model = build_model(job.model, side=data.side, classes=data.classes)
    device = worker_device(job.device)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=0.9)
    ctx = pt.init()
    # a job whose failed ranks are restarted sends its gradients through reliable collectives; in a restarted
    # rank, this is where it catches up with the others (before any other collective)
    # with --checkpoint-dir, a job started again after a total failure resumes here from the disk checkpoint
    wanted = ctx.settings.resilient or job.checkpoint_dir is not None
    spec = parse_strategy(job.strategy)
    hybrid = spec.hybrid
    reliable: Reliable | BuddyRecovery | None = None
    if wanted and spec.exchanges_parameters:  # each worker's own state, kept by a buddy (no broadcast: seeded)
        reliable = BuddyRecovery(lambda: training_state(model, optimizer), ctx)
    elif wanted:
        reliable = Reliable(ctx, checkpoint_dir=job.checkpoint_dir)
    dopt = ptt.DistributedOptimizer(
        optimizer,
        model=model,
        strategy=job.strategy,
        overlap=not job.no_overlap,
        reliable=reliable,
        compression=job.compression,
        bucket_bytes=job.bucket_bytes or DEFAULT_BUCKET_BYTES,
        batch_size=job.batch_size if hybrid else None,
        layer_schemes=parse_layer_schemes(job.layer_scheme) if hybrid else None,
    )
    if dopt.hybrid_plan is not None and ctx.rank == 0:
        print(dopt.hybrid_plan.table(), file=sys.stderr, flush=True)
    resumed = reliable.load_checkpoint() if reliable is not None else None
    if resumed is not None:
        try:
            restore_training_state(model, optimizer, resumed)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise SystemExit(
                f"the checkpoint to resume from does not fit this model and optimizer ({exc!r}); it was taken by "
                f"another training job: remove {job.checkpoint_dir or 'it'} or choose another --checkpoint-dir"
            ) from None
    elif isinstance(reliable, Reliable):
        reliable_broadcast_parameters(model, reliable)
    elif reliable is None and (not spec.uses_servers or hybrid):
        # (parameter servers hand every worker rank 0's parameters: no collective among the workers, which a
        # restarted one could not join)
        ptt.broadcast_parameters(model, root=0)
    return _Setup(data, model, optimizer, device, ctx, reliable, dopt, resumed)


def _evaluate_epoch(
    run: _Setup,
    job: TrainJob,
    rec: Recorder,
    *,
    epoch: int,
    step: int,
    train_loss: float,
    evaluating: float,
    quiet: bool,
    recording: bool = True,
) -> float:
    """The epoch's test accuracy and loss recorded (gossip's average model too, after the last epoch), the line
    printed by rank 0; returns the seconds spent evaluating so far. ``recording`` False: run again after a
    rollback (gossip's consensus is collective), recorded already."""
    t4 = time.time()
    accuracy, test_loss = tasks.evaluate(run.model, run.data.x_test, run.data.y_test)
    rec.add_span("evaluate", "eval", t4, time.time())
    eval_before, evaluating = evaluating, evaluating + time.time() - t4
    extra: dict[str, float] = {}
    if parse_strategy(job.strategy).exchanges_parameters and epoch == job.epochs - 1:
        # once, at the end: on a slow network the allreduce it needs would cost gossip's throughput
        live, x, y = _live(run), run.data.x_test, run.data.y_test
        guard = run.reliable.guarded if isinstance(run.reliable, BuddyRecovery) else _call
        extra = guard(lambda: consensus_eval(live, run.model, x, y))
    scores = {"train_loss": train_loss, "test_accuracy": accuracy, "test_loss": test_loss, **extra}
    times = {"eval_s": evaluating - eval_before, "eval_before_s": eval_before}
    if recording:
        record_epoch(rec, job, epoch, step, scores | times, printing=_live(run).rank == 0 and not quiet)
    return evaluating


def record_epoch(
    rec: Recorder, job: TrainJob, epoch: int, step: int, values: dict[str, float], *, printing: bool
) -> None:
    """An epoch's ``eval`` record (``values``: train and test loss, test accuracy, evaluation times and any
    more), and its line if ``printing``; for every worker kind, so that ``paratrain train`` reads them alike."""
    rec.log(kind="eval", epoch=epoch + 1, epochs=job.epochs, step=step, **values)
    if printing:
        line = epoch_line(epoch + 1, job.epochs, values["train_loss"], values["test_accuracy"], values["test_loss"])
        print(line, flush=True)


def _probe(run: _Setup, rec: Recorder, step: int, evaluating: float) -> float:
    """``--eval-every``: the accuracy on the first test examples, recorded; returns the seconds spent evaluating."""
    t5 = time.time()
    x, y = run.data.x_test[:PROBE_EXAMPLES], run.data.y_test[:PROBE_EXAMPLES]
    probe, _ = tasks.evaluate(run.model, x, y)
    spent = time.time() - t5
    rec.add_span("probe accuracy", "eval", t5, t5 + spent)
    rec.log(kind="probe", step=step, test_accuracy=probe, eval_s=spent, eval_before_s=evaluating)
    return evaluating + spent


def _begin(
    run: _Setup, job: TrainJob, rec: Recorder, steps: int, *, quiet: bool
) -> tuple[int, float, dict[int, float] | None]:
    """Where this process starts: the step, the seconds spent evaluating so far, and (a restarted parameter-server
    worker, which goes on at the clock its predecessor completed: :mod:`paratrain.ps.rejoin`) its predecessor's
    losses by step, None otherwise. Records the start, or the rejoin (and the epoch its predecessor ended without
    evaluating)."""
    resumed, ctx = run.resumed, run.ctx
    step = int(resumed.meta["step"]) if resumed is not None else run.dopt.resumed_step
    evaluating = float(resumed.meta["evaluating"]) if resumed is not None else 0.0  # excluded from time-to-accuracy
    if resumed is not None or (isinstance(run.reliable, BuddyRecovery) and run.reliable.restarted):
        return step, evaluating, None  # (a gossip replacement says it rejoined, in main)
    if not ctx.transport.rejoined:
        shards = ctx.settings.job_workers
        rec.log(kind="start", epochs=job.epochs, steps_per_epoch=steps, world_size=shards, strategy=job.strategy)
        return step, evaluating, None
    losses, evaluated = _predecessor(job, ctx.settings.member_id)
    rec.log(kind="rejoined", step=step)
    ended = step // steps
    if ended and step % steps == 0 and ended not in evaluated:  # it died between its epoch's end and evaluation
        train_loss = _loss_sum(losses, (ended - 1) * steps, step, ctx.rank) / steps
        evaluating = _evaluate_epoch(
            run, job, rec, epoch=ended - 1, step=step, train_loss=train_loss, evaluating=evaluating, quiet=quiet
        )
    return step, evaluating, losses


def _record_step(
    rec: Recorder, *, epoch: int, step: int, loss: float, samples: int, times: tuple[float, float, float, float],
    **extra: Any,
) -> None:  # fmt: skip
    """A step's spans (forward, backward, the wait for communication) and its metrics record."""
    t0, t1, t2, t3 = times
    rec.add_span("forward", "compute", t0, t1)
    rec.add_span("backward", "compute", t1, t2)
    rec.add_span("step (wait for communication)", "waiting", t2, t3)
    rec.log(kind="step", epoch=epoch, step=step, loss=loss, samples=samples, compute_s=t2 - t0, wait_s=t3 - t2, **extra)


def _predecessor(job: TrainJob, rank: int) -> tuple[dict[int, float], set[int]]:
    """What this rank's predecessor recorded before it died (a restarted parameter-server worker reports the
    interrupted epoch as the fault-free run does): each step's loss, and the epochs it evaluated."""
    records = rank_records(run_dir_of(job), rank)
    losses = {int(r["step"]): float(r["loss"]) for r in records if r.get("kind") in ("loss", "step")}
    return losses, {int(r["epoch"]) for r in records if r.get("kind") == "eval"}


def _loss_sum(losses: dict[int, float], first: int, last: int, rank: int) -> float:
    """The summed loss of steps ``first + 1 .. last``, added in order as the training loop adds it."""
    missing = [s for s in range(first + 1, last + 1) if s not in losses]
    if missing:
        print(f"rank {rank}: the epoch's train loss lacks steps {missing} (not recorded before the death)",
              file=sys.stderr)  # fmt: skip
    total = 0.0
    for s in range(first + 1, last + 1):
        total += losses.get(s, 0.0)
    return total


def _call(call: Callable[[], _T]) -> _T:
    return call()


def _live(run: _Setup) -> pt.Context:
    """The context in use now (a recovering job's is a new one)."""
    return run.reliable.ctx if run.reliable is not None else run.ctx


def _finish(run: _Setup, job: TrainJob, rec: Recorder, step: int) -> None:
    """The final parameters' digest recorded, the model saved by rank 0, everything closed."""
    import torch

    from paratrain.torch.resilient import parameters_digest

    rec.log(kind="final", step=step, parameters_sha256=parameters_digest(run.model))
    if _live(run).rank == 0:  # every data-parallel replica holds this model
        torch.save(run.model.state_dict(), os.path.join(run_dir_of(job), "model.pt"))
    close = getattr(run.dopt, "close", None)
    if callable(close):
        close()
    rec.close()
    pt.shutdown()


def _step(run: _Setup, job: TrainJob, rec: Recorder, *, order: Any, step: int, steps: int, straggler: Any) -> _Done:
    """Step ``step + 1`` (the batch of position ``step % steps`` in ``order``) computed and synchronised; again for the
    new job when an elastic job changes size during it (:class:`RegroupedError`)."""
    import torch

    data, model, device, dopt, reliable = run.data, run.model, run.device, run.dopt, run.reliable
    shards, batch = run.ctx.settings.job_workers, job.batch_size  # an elastic job keeps its launched size's batches
    while True:  # more than once only when an elastic job changes size during the step
        live = reliable.ctx if reliable is not None else run.ctx
        rank = live.rank
        share = step_share(order, shards=shards, batch=batch, step=step % steps, world_size=live.world_size, rank=rank)
        xb = torch.from_numpy(data.x_train[share.indices]).to(device)
        yb = torch.from_numpy(data.y_train[share.indices]).to(device)
        t0 = time.time()
        loss = tasks.loss(model(xb), yb)
        t1 = time.time()
        dopt.zero_grad()
        (loss if share.scale == 1.0 else loss * share.scale).backward()  # type: ignore[no-untyped-call]
        t2 = time.time()
        slow = straggler.factor(rank, step + 1) if straggler is not None else 1.0  # the step it is recorded as
        if slow != 1.0:  # emulate a straggler: this step's compute takes `slow` times as long
            time.sleep((t2 - t0) * (slow - 1.0))
            t2 = time.time()
        if run.ctx.settings.ps_worker_restarts:  # what a replacement reads if this process dies in the step
            rec.log(kind="loss", step=step + 1, loss=loss.item())
        try:
            dopt.step()
            return _Done(loss.item(), len(share.indices), (t0, t1, t2, time.time()), slow)
        except RegroupedError as exc:
            rec.log(kind="regrouped", step=step + 1, members=exc.members)


@dataclasses.dataclass(frozen=True, slots=True)
class _Done:
    """A step's loss, samples, times (forward, backward, synchronisation: :func:`_record_step`) and straggler factor."""

    loss: float
    samples: int
    times: tuple[float, float, float, float]
    slow: float


def _rolled_back(run: _Setup, rec: Recorder, exc: RolledBackError, step: int) -> tuple[int, float]:
    """A death rolled the job back (gossip): this rank's state of the checkpoint restored; returns its step and
    the epoch's loss so far. Steps up to ``step`` were recorded already: they run again unrecorded."""
    from paratrain.torch.resilient import restore_training_state

    assert isinstance(run.reliable, BuddyRecovery)
    ckpt = exc.checkpoint
    restore_training_state(run.model, run.optimizer, ckpt)
    run.reliable.replay_until = max(run.reliable.replay_until, step)
    back = int(ckpt.meta["step"])
    rec.log(kind="rollback", step=back, from_step=step)
    return back, float(ckpt.meta["epoch_loss"])


def main(argv: list[str] | None = None) -> None:
    """Trains this rank's part of the job and records everything in the job's run directory."""
    job, quiet = worker_job(argv, __doc__)

    from paratrain.torch.resilient import training_state

    try:
        run = _setup(job)
    except WorkDoneError as exc:  # a parameter-server worker killed after its work was done: that work stands
        print(f"{exc}; nothing left to do", file=sys.stderr)
        pt.shutdown()
        return
    ctx, reliable, resumed = run.ctx, run.reliable, run.resumed
    # files are named by member: in an elastic job ranks are renumbered when workers leave or join
    rec = Recorder(run_dir_of(job), rank=ctx.settings.member_id)
    straggler = stragglers.parse(job.straggler, seed=job.seed) if job.straggler else None
    steps = epoch_steps(job, len(run.data.y_train) // ctx.settings.job_workers, "this worker")
    step, evaluating, losses = _begin(run, job, rec, steps, quiet=quiet)
    rolls_back = isinstance(reliable, BuddyRecovery)
    evaluated: set[int] = set()  # epochs (from 1) whose evaluation is recorded
    if isinstance(reliable, BuddyRecovery) and reliable.restarted:  # what its predecessor recorded
        recorded, evaluated = _predecessor(job, ctx.settings.member_id)
        reliable.replay_until = max((s for s, _ in recorded.items()), default=0)
        rec.log(kind="rejoined", step=step)  # its state received, every worker rolled back: training again
    seen_recoveries = 0
    traffic = _Traffic(ctx)
    epoch_loss = 0.0
    if step % steps and resumed is not None:
        epoch_loss = float(resumed.meta["epoch_loss"])
    elif step % steps and losses is not None:  # a restarted parameter-server worker: its predecessor's steps
        epoch_loss = _loss_sum(losses, step - step % steps, step, ctx.rank)
    while step < job.epochs * steps or (reliable is not None and not run.dopt.closed):
        if reliable is not None:
            for recovery in reliable.recoveries[seen_recoveries:]:
                rec.log(kind="recovery", step=step, **dataclasses.asdict(recovery))
            seen_recoveries = len(reliable.recoveries)
        replaying = reliable is not None and reliable.replaying_at(step)
        try:
            if step == job.epochs * steps:  # (a job that recovers) completes its last exchange here
                run.dopt.close()
                continue
            order = epoch_order(job, len(run.data.y_train), step // steps)
            done = _step(run, job, rec, order=order, step=step, steps=steps, straggler=straggler)
        except RolledBackError as exc:
            step, epoch_loss = _rolled_back(run, rec, exc, step)
            continue
        step += 1
        epoch_loss += done.loss
        if not replaying:  # a replaying rank replaces a process that recorded this step already
            extra = {"straggler_factor": done.slow} if straggler is not None else {}
            extra |= traffic.update(_live(run))
            _record_step(rec, epoch=(step - 1) // steps + 1, step=step, loss=done.loss, samples=done.samples,
                         times=done.times, **extra)  # fmt: skip
        if reliable is not None and step % job.checkpoint_every == 0:
            state = training_state(run.model, run.optimizer)
            try:
                reliable.checkpoint(state, {"step": step, "epoch_loss": epoch_loss, "evaluating": evaluating})
            except RolledBackError as exc:
                step, epoch_loss = _rolled_back(run, rec, exc, step)
                continue
        if not replaying and job.eval_every > 0 and step % job.eval_every == 0:
            evaluating = _probe(run, rec, step, evaluating)
        # an epoch is evaluated once: not while replaying results (the process it replaces did), nor again after a
        # gossip rollback (whose replacement knows what its predecessor evaluated) -- but gossip's last epoch runs
        # its consensus allreduce again on every rank (a predecessor may have died after it, before recording)
        epoch_done = step // steps if step % steps == 0 else 0
        consensus = rolls_back and epoch_done == job.epochs
        if epoch_done and (epoch_done not in evaluated or consensus) and not (replaying and not rolls_back):
            try:
                evaluating = _evaluate_epoch(
                    run, job, rec, epoch=epoch_done - 1, step=step, train_loss=epoch_loss / steps,
                    evaluating=evaluating, quiet=quiet, recording=epoch_done not in evaluated,
                )  # fmt: skip
            except RolledBackError as exc:  # (gossip's consensus, an allreduce, met the death)
                step, epoch_loss = _rolled_back(run, rec, exc, step)
                continue
            evaluated.add(epoch_done)
        if step % steps == 0:
            epoch_loss = 0.0
    _finish(run, job, rec, step)


def epoch_order(job: TrainJob, examples: int, epoch: int) -> Any:
    """The training set's order in ``epoch``: the same on every rank and in every run."""
    return np.random.default_rng(job.seed * 1_000_003 + epoch).permutation(examples)


if __name__ == "__main__":
    exit_with(main)
