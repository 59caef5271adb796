"""One rank of ``paratrain train --strategy tp:N`` or ``soap:FILE``: its part of every split layer, under the launcher.

The job's W workers form a ``tensor x data`` grid (:class:`paratrain.soap.Mesh`): consecutive ranks share a
tensor group and hold the parts of each split layer; the groups train data parallel, each on its shard of the
training set (a fresh permutation each epoch, the same on every rank, cut into ``data`` parts as ``allreduce``
cuts it into workers), ``--batch-size`` examples per group per step. The members of a group read the same examples.

Update rule: that of ``allreduce`` (the unit's, in :mod:`paratrain.strategy.builtin`): each group's mean loss, the
gradients averaged over the data groups, SGD with momentum; so ``tp:N`` on ``N x D`` workers trains what
``allreduce`` on D workers trains, up to the order of float additions inside the split layers.

Each step is recorded as spans (forward and backward include the activations' moves over the tensor group;
``step`` is the data groups' gradient average and the optimizer) and a metrics line. The start record carries
the parameters each worker holds, against the unsplit model's. At the end the unsplit model is gathered and
rank 0 saves it as ``model.pt``, loadable into ``build_model``'s model.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import paratrain as pt
from paratrain._exit import exit_with
from paratrain.soap import Mesh, SoapConfig
from paratrain.strategy import parse_strategy
from paratrain.train import tasks
from paratrain.train.data import load_dataset
from paratrain.train.job import PROBE_EXAMPLES, TrainJob, epoch_steps, run_dir_of, worker_job
from paratrain.train.models import build_model
from paratrain.train.record import Recorder
from paratrain.train.shards import step_share
from paratrain.train.worker import record_epoch

__all__ = ["configuration", "main"]


def configuration(job: TrainJob) -> SoapConfig:
    """The per-layer configuration ``job.strategy`` names (:meth:`SoapConfig.named`).

    Raises:
        SoapConfigError: the file cannot be read or holds no configuration.
    """
    return SoapConfig.named(parse_strategy(job.strategy).options)


def _held(module: Any) -> int:
    """Bytes of the parameters ``module`` holds (read from its tensors)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def main(argv: list[str] | None = None) -> None:
    """Trains this rank's part of the split model and records everything in the job's run directory."""
    job, quiet = worker_job(argv, __doc__)

    import torch

    from paratrain.torch.resilient import parameters_digest
    from paratrain.torch.soap import parallelize, splits_of

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    torch.manual_seed(job.seed)
    data = load_dataset(job.dataset, data_dir=job.data_dir)
    whole = build_model(job.model, side=data.side, classes=data.classes)
    ctx = pt.init()
    config = configuration(job).workers(ctx.world_size)
    mesh = Mesh.for_workers(ctx.world_size, config.tensor)
    model = parallelize(whole, splits_of(whole, config), ctx, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=0.9)
    rec = Recorder(run_dir_of(job), rank=ctx.rank)
    groups, group = mesh.data, mesh.coordinates(ctx.rank)[1]
    steps = epoch_steps(job, len(data.y_train) // groups, "a data group")
    rec.log(
        kind="start", epochs=job.epochs, steps_per_epoch=steps, world_size=ctx.world_size, strategy=job.strategy,
        tensor=mesh.tensor, data=mesh.data, splits=dict(model.plan_splits()), params_bytes=_held(model),
        whole_params_bytes=_held(whole),
    )  # fmt: skip
    step, evaluating = 0, 0.0
    for epoch in range(job.epochs):
        order = np.random.default_rng(job.seed * 1_000_003 + epoch).permutation(len(data.y_train))
        epoch_loss = 0.0
        for i in range(steps):
            share = step_share(order, shards=groups, batch=job.batch_size, step=i, world_size=groups, rank=group)
            xb, yb = torch.from_numpy(data.x_train[share.indices]), torch.from_numpy(data.y_train[share.indices])
            t0 = time.time()
            loss = tasks.loss(model(xb), yb)
            t1 = time.time()
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            t2 = time.time()
            model.average_gradients()
            optimizer.step()
            t3 = time.time()
            step += 1
            value = loss.item()
            epoch_loss += value
            rec.add_span("forward", "compute", t0, t1)
            rec.add_span("backward", "compute", t1, t2)
            rec.add_span("step (average over data groups)", "waiting", t2, t3)
            rec.log(
                kind="step", epoch=epoch + 1, step=step, loss=value, samples=len(share.indices), compute_s=t2 - t0,
                wait_s=t3 - t2, bytes_sent=ctx.transport.stats.bytes_sent,
                allreduce_bytes=sum(g.collectives.allreduce_bytes for g in (model.tensor_group, model.data_group)),
            )  # fmt: skip
            if job.eval_every > 0 and step % job.eval_every == 0:  # every rank: the split layers' moves
                t5 = time.time()
                probe, _ = tasks.evaluate(model, data.x_test[:PROBE_EXAMPLES], data.y_test[:PROBE_EXAMPLES])
                spent = time.time() - t5
                rec.add_span("probe accuracy", "eval", t5, t5 + spent)
                rec.log(kind="probe", step=step, test_accuracy=probe, eval_s=spent, eval_before_s=evaluating)
                evaluating += spent
        t4 = time.time()
        accuracy, test_loss = tasks.evaluate(model, data.x_test, data.y_test)  # every rank: its group's moves
        rec.add_span("evaluate", "eval", t4, time.time())
        spent = time.time() - t4
        scores = {"train_loss": epoch_loss / steps, "test_accuracy": accuracy, "test_loss": test_loss}
        times = {"eval_s": spent, "eval_before_s": evaluating}
        evaluating += spent
        record_epoch(rec, job, epoch, step, scores | times, printing=ctx.rank == 0 and not quiet)
    state = model.full_state()  # collective over the tensor group
    rec.log(kind="final", step=step, parameters_sha256=parameters_digest(state))
    if ctx.rank == 0:
        whole.load_state_dict({name: torch.from_numpy(value) for name, value in state.items()})
        torch.save(whole.state_dict(), os.path.join(run_dir_of(job), "model.pt"))
    rec.close()
    pt.shutdown()


if __name__ == "__main__":
    exit_with(main)
