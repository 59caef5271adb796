"""One pipeline-parallel training step from a model profile: the runtime's stage split, its schedule's plan.

A pipeline job (``paratrain train --strategy pipeline:gpipe|1f1b --stages K --microbatches M``) cuts the model's
flat list of modules (nested ``nn.Sequential`` opened up) into K contiguous stages, one process each, and runs
M micro-batches of ``batch / M`` examples through them in the schedule's order, flushing at every step. The
simulator composes that step from the same pure functions the runtime runs:

* the split: :func:`paratrain.pipeline.partition.partition` (what the runtime's ``balance="auto"`` runs, here
  also weighing each boundary's activation on the job's links) over the modules' profiled costs per
  micro-batch. Profiled layers (modules with parameters) carry their forward and
  backward time scaled from the profiled batch to the micro-batch (linear in the examples: small micro-batches
  use the cores less well, so this is optimistic for them); the other modules (activations, pooling, the loss)
  share the profile's ``overhead_s`` in proportion to the layers' compute. Their output is the activation the
  previous layer produced. The split is returned as ``--balance`` so that a run uses exactly it (the runtime's
  own auto split profiles at run time and may differ);
* the step: :func:`paratrain.pipeline.schedules.lower` of the schedule with those per-stage times, the
  activations of each boundary (the input's size out of parameterless modules in front), each stage's share of
  the optimizer step, and no gradients back to stages in front of the first with parameters (as the runtime);
  replayed on the network's links, the stages sharing the cores as the profile saw them shared.

A step is one replay (the schedules flush: no step overlaps the next). The expected wait for the slowest process
(``straggle_s``) is not added: stages do not run the same work at the same time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.errors import ConfigError
from paratrain.pipeline.partition import LayerCost as StageCost
from paratrain.pipeline.partition import partition
from paratrain.pipeline.schedules import SCHEDULES, gradient_from, lower, schedule
from paratrain.plan.ir import Plan
from paratrain.sim.machine import ModelProfile

__all__ = ["PipelineStep", "pipeline_step"]


@dataclass(frozen=True)
class PipelineStep:
    """A pipeline step's plan and the split it uses.

    Attributes:
        plan: one rank per stage, as :func:`~paratrain.pipeline.schedules.lower` makes it.
        balance: modules per stage (``--balance``).
        microbatch: examples per micro-batch.
    """

    plan: Plan
    balance: tuple[int, ...]
    microbatch: int


def pipeline_step(
    model: ModelProfile,
    *,
    stages: int,
    microbatches: int,
    batch_size: int,
    schedule_name: str = "gpipe",
    bandwidth: float = math.inf,
) -> PipelineStep:
    """The step of a pipeline of ``stages`` over ``model`` with ``microbatches`` of ``batch_size / microbatches``
    examples each (see the module docstring). ``bandwidth`` (bytes/s of the links between stages) makes the
    split weigh each boundary's activation there and back, as PipeDream's planner does; the runtime's
    ``balance="auto"`` ignores it (it splits on compute alone).

    Raises:
        ConfigError: a schedule the simulator does not compose (the flushing ones, gpipe and 1f1b), a profile
            without the model's module structure (profiled before it was recorded: profile again), a batch that
            does not split into the micro-batches, or fewer modules than stages.

    Example:
        >>> from paratrain.sim.machine import LayerCost
        >>> layers = tuple(
        ...     LayerCost(f"{2 * i}", 0.01, 0.02, (f"{2 * i}.weight",), (4000,), 2560, module=2 * i) for i in range(4)
        ... )
        >>> step = pipeline_step(ModelProfile("m", 64, layers, modules=8), stages=2, microbatches=4, batch_size=64)
        >>> step.balance, step.microbatch, step.plan.world_size
        ((3, 5), 16, 2)
    """
    if schedule_name not in ("gpipe", "1f1b"):
        raise ConfigError(
            f"the simulator composes the flushing pipeline schedules gpipe and 1f1b, not {schedule_name!r} "
            f"(paratrain has {', '.join(SCHEDULES)})"
        )
    if model.modules < 1 or any(layer.module < 0 for layer in model.layers):
        raise ConfigError(
            f"the profile of {model.model!r} lacks its module structure (profiled before paratrain recorded it); "
            f"run 'paratrain profile --model {model.model}' again"
        )
    if stages < 1 or microbatches < 1 or batch_size % microbatches:
        raise ConfigError(
            f"a batch of {batch_size} does not split into {microbatches} micro-batches of {stages} stages"
        )
    if model.modules < stages:
        raise ConfigError(f"{model.model} has {model.modules} modules, too few for {stages} stages")
    microbatch = batch_size // microbatches
    scale = microbatch / model.batch_size
    layer_s = sum(layer.forward_s + layer.backward_s for layer in model.layers) or 1.0
    forward = [0.0] * model.modules
    backward = [0.0] * model.modules
    activation = [0] * model.modules
    params = [0] * model.modules
    for layer in model.layers:
        share = 1.0 + model.overhead_s / layer_s  # the parameterless modules' time, spread over the layers
        forward[layer.module] += layer.forward_s * share * scale
        backward[layer.module] += layer.backward_s * share * scale
        activation[layer.module] = int(layer.output_bytes * scale)
        params[layer.module] += sum(layer.param_bytes)
    for i in range(model.modules):  # an activation or pooling passes its input's size on (roughly)
        if not params[i] and not activation[i]:
            activation[i] = activation[i - 1] if i else int(model.input_bytes * scale)
    costs = [StageCost(forward[i] + backward[i], activation[i], params[i]) for i in range(model.modules)]
    split = partition(costs, stages, bandwidth=bandwidth)
    total_params = sum(params) or 1
    f_s, b_s, opt_s, act = [], [], [], []
    for first, stop in split.bounds:
        f_s.append(sum(forward[first:stop]))
        b_s.append(sum(backward[first:stop]))
        opt_s.append(model.optimizer_s * sum(params[first:stop]) / total_params)
        act.append(activation[stop - 1])
    first_learner = gradient_from([sum(params[first:stop]) > 0 for first, stop in split.bounds])
    plan = lower(
        schedule(schedule_name, stages, microbatches),
        forward_s=f_s,
        backward_s=b_s,
        step_s=opt_s,
        activation_bytes=act,
        first_learner=first_learner,
    )
    return PipelineStep(plan, split.balance, microbatch)
