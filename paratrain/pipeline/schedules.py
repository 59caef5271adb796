"""Pipeline schedules as pure data: GPipe fill-drain, 1F1B (PipeDream-Flush) and PipeDream's asynchronous 1F1B.

A schedule says, for each of K stages, the order in which it runs the forward (``F``) and backward (``B``) of
each of M micro-batches and its optimizer steps (``S``), and which weight version every ``F`` and ``B`` uses.
Communication is implied by the order and made explicit when lowering: ``F m`` on stage s needs stage s - 1's
activation of m and sends its own to s + 1; ``B m`` needs stage s + 1's gradient and sends one to s - 1.

::

    GPipe, K = 3, M = 4 (time ->)              1F1B, K = 3, M = 4
    stage 0  F0 F1 F2 F3 .  .  .  .  B0 ..      F0 F1 F2 .  B0 F3 B1 .  B2 .  B3
    stage 1  .  F0 F1 F2 F3 .  .  B0 ..         .  F0 F1 B0 F2 B1 F3 B2 .  B3
    stage 2  .  .  F0 F1 F2 F3 B0 ..            .  .  F0 B0 F1 B1 F2 B2 F3 B3

GPipe holds all M micro-batches' activations at once; 1F1B starts backward as early as possible and holds at
most K - s on stage s, with the same bubble (K - 1)/(M + K - 1) and the same gradients. PipeDream (no flush)
takes a step after every backward; weight stashing keeps, for every micro-batch in flight, the version its
forward used, so that its backward uses the same weights (Narayanan et al., SOSP 2019).

The same schedule is executed by the runtime, replayed by the cost model (:func:`lower` gives the plan IR of
:mod:`paratrain.plan`, with per-stage compute times) and checked here: :func:`check` proves it deadlock-free and
counts its bubble and peak in-flight activations without running any model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from paratrain.plan.cost import simulate
from paratrain.plan.ir import Plan, PlanBuilder, PlanError

__all__ = [
    "DONE",
    "SCHEDULES",
    "Check",
    "Schedule",
    "Step",
    "activation_tag",
    "check",
    "done_tag",
    "gpipe",
    "gradient_from",
    "gradient_tag",
    "lower",
    "one_f_one_b",
    "pipedream",
    "schedule",
]

StepKind = Literal["F", "B", "S"]


def activation_tag(microbatch: int) -> int:
    """Tag offset of micro-batch m's activation (forward); its gradient's is one more. Tagging by micro-batch
    lets a stage receive them in any order its schedule wants."""
    return 2 * microbatch


def gradient_tag(microbatch: int) -> int:
    """Tag offset of micro-batch m's gradient (backward)."""
    return 2 * microbatch + 1


#: The label of the empty message that ends a step of a stage in front of the first learner (:func:`done_tag`).
DONE = "done"


def done_tag(microbatches: int) -> int:
    """Tag offset of the empty message that ends a step of a stage in front of the first learner (see
    :func:`gradient_from`): the first after the micro-batches' own."""
    return 2 * microbatches


class Step(NamedTuple):
    """One compute step of a stage: ``F``/``B`` of micro-batch ``microbatch`` with weight version ``version``,
    or ``S``, the optimizer step that makes version ``version`` (``microbatch`` is -1)."""

    kind: StepKind
    microbatch: int
    version: int

    def __str__(self) -> str:
        return f"S{self.version}" if self.kind == "S" else f"{self.kind}{self.microbatch}"


@dataclass(frozen=True, slots=True)
class Schedule:
    """The steps of every stage, in order.

    Attributes:
        name: ``"gpipe"``, ``"1f1b"``, ``"pipedream"`` or ``"pipedream-vsync"``.
        stages: ``stages[s]`` is stage s's steps.
        microbatches: M.
    """

    name: str
    stages: tuple[tuple[Step, ...], ...]
    microbatches: int

    @property
    def num_stages(self) -> int:
        """K."""
        return len(self.stages)

    def table(self) -> list[str]:
        """Each stage's steps as one string, e.g. ``"F0 F1 B0 B1 S1"``: what tests compare with exact tables."""
        return [" ".join(str(step) for step in steps) for steps in self.stages]


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch, got {stages} and {microbatches}")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe's fill-drain (Huang et al. 2019): every forward, then every backward, then one optimizer step.

    Example:
        >>> gpipe(2, 3).table()
        ['F0 F1 F2 B0 B1 B2 S1', 'F0 F1 F2 B0 B1 B2 S1']
    """
    _check_sizes(stages, microbatches)
    steps = (
        *(Step("F", m, 0) for m in range(microbatches)),
        *(Step("B", m, 0) for m in range(microbatches)),
        Step("S", -1, 1),
    )
    return Schedule("gpipe", tuple(steps for _ in range(stages)), microbatches)


def _one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[tuple[StepKind, int]]:
    """Warm-up forwards (K - s - 1 of them), then alternate one forward and one backward, then the rest of the
    backwards: PipeDream's 1F1B order, which the flushed and the asynchronous schedules share."""
    warmup = min(stages - stage - 1, microbatches)
    order: list[tuple[StepKind, int]] = [("F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while forward < microbatches:
        order.append(("F", forward))
        forward += 1
        order.append(("B", backward))
        backward += 1
    order.extend(("B", m) for m in range(backward, microbatches))
    return order


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B with a flush at the end (PipeDream-Flush, Narayanan et al. 2021; torch's ``Schedule1F1B``): the same
    gradients as GPipe, one optimizer step per mini-batch, at most K - s micro-batches in flight on stage s.

    Example:
        >>> one_f_one_b(3, 4).table()
        ['F0 F1 F2 B0 F3 B1 B2 B3 S1', 'F0 F1 B0 F2 B1 F3 B2 B3 S1', 'F0 B0 F1 B1 F2 B2 F3 B3 S1']
    """
    _check_sizes(stages, microbatches)
    return Schedule(
        "1f1b",
        tuple(
            (*(Step(kind, m, 0) for kind, m in _one_f_one_b_order(s, stages, microbatches)), Step("S", -1, 1))
            for s in range(stages)
        ),
        microbatches,
    )


def pipedream(stages: int, microbatches: int, *, vertical_sync: bool = False) -> Schedule:
    """PipeDream's asynchronous 1F1B with weight stashing: every micro-batch is a mini-batch, each stage takes an
    optimizer step right after each backward, and no flush ever drains the pipeline.

    A forward uses the newest weights of its stage (the number of steps taken so far there); its backward uses
    the *same* version, stashed (weight stashing). With ``vertical_sync`` every stage uses, for micro-batch m,
    the version stage 0 used for m, so one micro-batch sees one consistent model across stages (at the price of
    stashing more versions).

    Example:
        >>> pipedream(2, 3).table()
        ['F0 F1 B0 S1 F2 B1 S2 B2 S3', 'F0 B0 S1 F1 B1 S2 F2 B2 S3']
        >>> [s.version for s in pipedream(2, 3).stages[0] if s.kind == "F"]
        [0, 0, 1]
    """
    _check_sizes(stages, microbatches)
    orders = [_one_f_one_b_order(s, stages, microbatches) for s in range(stages)]
    newest: list[dict[int, int]] = []  # stage -> micro-batch -> the newest version when its forward ran
    for order in orders:
        steps_taken, seen = 0, {}
        for kind, m in order:
            if kind == "F":
                seen[m] = steps_taken
            else:
                steps_taken += 1
        newest.append(seen)
    result = []
    for s, order in enumerate(orders):
        steps: list[Step] = []
        taken = 0
        for kind, m in order:
            version = newest[0][m] if vertical_sync else newest[s][m]
            steps.append(Step(kind, m, version))
            if kind == "B":
                taken += 1
                steps.append(Step("S", -1, taken))
        result.append(tuple(steps))
    return Schedule("pipedream-vsync" if vertical_sync else "pipedream", tuple(result), microbatches)


#: The schedules by name, as ``--strategy pipeline:NAME`` spells them.
SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "pipedream": pipedream,
    "pipedream-vsync": functools.partial(pipedream, vertical_sync=True),
}


def schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule ``name`` (see :data:`SCHEDULES`).

    Raises:
        ValueError: unknown name or sizes below 1.
    """
    maker = SCHEDULES.get(name)
    if maker is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return maker(stages, microbatches)


# -- lowering and checking ------------------------------------------------------------------------------------


def gradient_from(learns: Sequence[bool]) -> int:
    """The first stage that has parameters to train, given whether each stage does (``len(learns)`` if none).

    Gradients flow back only as far as it: the stages in front of it (parameterless modules such as a
    Flatten) learn nothing, so they get no gradient message and run no backward, and it computes no gradient
    of its input. Each saved hop is a message per micro-batch the size of the activation.

    Example:
        >>> gradient_from([False, True, True]), gradient_from([True, False]), gradient_from([False, False])
        (1, 0, 2)
    """
    return next((s for s, yes in enumerate(learns) if yes), len(learns))


def lower(
    sched: Schedule,
    *,
    forward_s: Sequence[float] | float = 1.0,
    backward_s: Sequence[float] | float = 2.0,
    step_s: Sequence[float] | float = 0.0,
    activation_bytes: Sequence[int] | int = 0,
    first_learner: int = 0,
) -> Plan:
    """The schedule as a plan (:mod:`paratrain.plan.ir`): per stage, the receive each step needs, the step as a
    ``compute`` of the given duration (labelled ``str(step)``), and the send of its output, which depends on that
    compute. Receives are posted when their step comes; sends never block (the runtime's transport buffers them),
    as in the plan IR. This is what :meth:`paratrain.torch.pipeline.Pipe.step` executes, action by action, with
    tags as offsets below the step's first tag; the sizes are the runtime's tensors', given here for the cost model.

    Args:
        sched: the schedule.
        forward_s, backward_s: seconds of one micro-batch's forward/backward, per stage or for all.
        step_s: seconds of an optimizer step, per stage or for all.
        activation_bytes: bytes of stage s's output activation (its gradient has the same size), per stage or all.
        first_learner: :func:`gradient_from` of the stages: the stages before it run no backward (no gradient
            comes to them; a ``release`` of the micro-batch stands in its place) and it sends no gradient back, as
            the runtime does; instead each stage up to it sends the one before an empty message (labelled
            :data:`DONE`, tag :func:`done_tag`) when its step ends, which ends that one's step.
    """
    k = sched.num_stages

    def per_stage(value: Sequence[float] | float, s: int) -> float:
        return float(value if isinstance(value, (int, float)) else value[s])

    ranks = []
    for s, steps in enumerate(sched.stages):
        b = PlanBuilder()
        act_in = int(per_stage(activation_bytes, s - 1)) if s > 0 else 0
        act_out = int(per_stage(activation_bytes, s))
        for step in steps:
            label = str(step)
            if step.kind == "S":
                b.compute(label, seconds=per_stage(step_s, s))
            elif step.kind == "F":
                deps = (
                    [b.message("recv", s - 1, nbytes=act_in, tag=activation_tag(step.microbatch), label=label)]
                    if s > 0
                    else []
                )
                ran = b.compute(label, seconds=per_stage(forward_s, s), deps=deps)
                if s < k - 1:
                    tag = activation_tag(step.microbatch)
                    b.message("send", s + 1, nbytes=act_out, tag=tag, label=label, deps=[ran])
            elif s < first_learner:
                b.release(label)
            else:
                deps = (
                    [b.message("recv", s + 1, nbytes=act_out, tag=gradient_tag(step.microbatch), label=label)]
                    if s < k - 1
                    else []
                )
                ran = b.compute(label, seconds=per_stage(backward_s, s), deps=deps)
                if s > first_learner:
                    tag = gradient_tag(step.microbatch)
                    b.message("send", s - 1, nbytes=act_in, tag=tag, label=label, deps=[ran])
        last = len(b.actions) - 1
        done = done_tag(sched.microbatches)
        if s < first_learner and s < k - 1:
            last = b.message("recv", s + 1, nbytes=0, tag=done, label=DONE, deps=[last])
        if 0 < s <= first_learner:
            b.message("send", s - 1, nbytes=0, tag=done, label=DONE, deps=[last])
        ranks.append(b.actions)
    return Plan(f"pipeline/{sched.name}", tuple(ranks))


@dataclass(frozen=True, slots=True)
class Check:
    """What :func:`check` found.

    Attributes:
        makespan: time from the first step to the last, with the given step times and free communication.
        bubble: the idle share of all stages over the makespan (``1 - busy / (K * makespan)``).
        peak_activations: per stage, the most micro-batches whose forward ran and backward did not yet.
        peak_versions: per stage, the most weight versions held at once (stashed ones included).
    """

    makespan: float
    bubble: float
    peak_activations: tuple[int, ...]
    peak_versions: tuple[int, ...]


def check(sched: Schedule, *, forward_s: float = 1.0, backward_s: float = 2.0) -> Check:
    """Proves ``sched`` complete and deadlock-free and measures it, without running a model.

    Complete: every stage runs F then B of every micro-batch exactly once. Deadlock-free: the lowered plan
    replays to the end (a step waiting for a message never sent first raises). The bubble is the replay's; for
    GPipe and 1F1B with uniform stages it is (K - 1)/(M + K - 1).

    Raises:
        PlanError: an incomplete schedule, a backward before its forward, or a deadlock.

    Example:
        >>> c = check(one_f_one_b(4, 8))
        >>> round(c.bubble, 4), c.peak_activations
        (0.2727, (4, 3, 2, 1))
    """
    for s, steps in enumerate(sched.stages):
        forwards = [st.microbatch for st in steps if st.kind == "F"]
        backwards = [st.microbatch for st in steps if st.kind == "B"]
        everyone = list(range(sched.microbatches))
        if sorted(forwards) != everyone or sorted(backwards) != everyone:
            raise PlanError(f"{sched.name}: stage {s} does not run F and B of every micro-batch exactly once")
        position = {(st.kind, st.microbatch): i for i, st in enumerate(steps)}
        late = [m for m in everyone if position[("B", m)] < position[("F", m)]]
        if late:
            raise PlanError(f"{sched.name}: stage {s} runs the backward of micro-batch {late[0]} before its forward")
    plan = lower(sched, forward_s=forward_s, backward_s=backward_s)
    makespan = simulate(plan, alpha=0.0, beta=0.0).time
    busy = sched.microbatches * (forward_s + backward_s) * sched.num_stages
    peaks, versions = [], []
    for steps in sched.stages:
        live = peak = 0
        held: dict[int, int] = {}  # version -> micro-batches in flight that use it
        most = 1
        current = 0
        for st in steps:
            if st.kind == "F":
                live += 1
                held[st.version] = held.get(st.version, 0) + 1
            elif st.kind == "B":
                live -= 1
                held[st.version] -= 1
                if not held[st.version]:
                    del held[st.version]
            else:
                current = st.version
            peak = max(peak, live)
            most = max(most, len(held.keys() | {current}))
        peaks.append(peak)
        versions.append(most)
    return Check(
        makespan=makespan,
        bubble=1.0 - busy / (sched.num_stages * makespan) if makespan > 0 else 0.0,
        peak_activations=tuple(peaks),
        peak_versions=tuple(versions),
    )
