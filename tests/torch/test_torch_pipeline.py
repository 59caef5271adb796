"""Pipelines train what one process trains: GPipe and 1F1B parameters equal non-pipelined training, per tensor.

Every schedule x 2-4 stages x 1-8 micro-batches (fewer than stages included), float64, several optimizer steps
with momentum; PipeDream: every forward and backward used exactly the weight version its schedule says.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.pipeline.partition import LayerCost, partition
from paratrain.pipeline.schedules import lower
from paratrain.pipeline.schedules import schedule as pipeline_schedule
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.torch.pipeline import Pipe

STEPS, BATCH, IN, OUT = 3, 8, 5, 3


def _layers() -> list[nn.Module]:
    """A fresh copy of one model (built once: threads must not share torch's global generator while seeding)."""
    return copy.deepcopy(_TEMPLATE)


def _build() -> list[nn.Module]:
    torch.manual_seed(7)
    return [
        nn.Linear(IN, 6, dtype=torch.float64),
        nn.Tanh(),
        nn.Linear(6, 6, dtype=torch.float64),
        nn.Tanh(),
        nn.Linear(6, 6, dtype=torch.float64),
        nn.Tanh(),
        nn.Linear(6, OUT, dtype=torch.float64),
        nn.Identity(),
    ]


_TEMPLATE = _build()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=gen, dtype=torch.float64), torch.randn(
        BATCH, OUT, generator=gen, dtype=torch.float64
    )


def _optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _balance(stages: int) -> list[int]:
    return list(partition([LayerCost(1.0)] * len(_layers()), stages).balance)


def _reference(microbatches: int) -> list[np.ndarray]:
    """One process, the whole model: the summed loss of the micro-batches, one step per mini-batch."""
    model = nn.Sequential(*_layers())
    opt = _optimizer(list(model.parameters()))
    loss_fn = nn.MSELoss(reduction="sum")
    for step in range(STEPS):
        x, y = _batch(step)
        for xm, ym in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches), strict=True):
            loss_fn(model(xm), ym).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().copy() for p in model.parameters()]


def _pipelined(
    stages: int, microbatches: int, schedule: str, *, checkpoint: bool = False, p2p: str = "auto"
) -> list[tuple[list[np.ndarray], list]]:
    def stage(ctx: Context) -> tuple[list[np.ndarray], list]:
        pipe = Pipe(
            _layers(),
            balance=_balance(stages),
            microbatches=microbatches,
            schedule=schedule,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            checkpoint=checkpoint,
            p2p=p2p,
        )
        for step in range(STEPS):
            x, y = _batch(step)
            pipe.step(x, y)
        if p2p == "gloo":  # the links carried every activation and gradient
            assert pipe.links is not None and all(link.calls > 0 for link in pipe.links[: 1 if stages == 1 else 2])
        pipe.close()
        return [p.detach().numpy().copy() for p in pipe.module.parameters()], pipe.versions

    return run_ranks(stages, stage, timeout=120)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 8])
def test_flushed_pipelines_equal_one_process_per_parameter(schedule: str, stages: int, microbatches: int) -> None:
    reference = _reference(microbatches)
    results = _pipelined(stages, microbatches, schedule)
    got = [p for params, _ in results for p in params]
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=f"parameter {i}")


@pytest.mark.parametrize("vertical_sync", [False, True])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 3, 8])
def test_pipedream_uses_the_planned_weight_version_for_every_step(
    stages: int, microbatches: int, vertical_sync: bool
) -> None:
    results = _pipelined(stages, microbatches, "pipedream-vsync" if vertical_sync else "pipedream")
    from paratrain.pipeline.schedules import pipedream

    plan = pipedream(stages, microbatches, vertical_sync=vertical_sync)
    for s, (_, versions) in enumerate(results):
        per_step = [(st.kind, st.microbatch, st.version) for st in plan.stages[s] if st.kind != "S"]
        # every mini-batch runs the schedule again; versions keep counting across mini-batches
        taken = sum(1 for st in plan.stages[s] if st.kind == "S")
        expected = [(k, m, v + step * taken) for step in range(STEPS) for k, m, v in per_step]
        assert versions == expected, f"stage {s}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream", "pipedream-vsync"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 3), (3, 8), (4, 2)])
def test_stages_linked_by_a_process_group_train_exactly_as_through_host_memory(
    schedule: str, stages: int, microbatches: int
) -> None:
    """``p2p="gloo"``: activations and gradients through two Gloo process groups (one per direction; every send
    under one tag, so they match in order, as NCCL's do), shapes announced through the transport: the same
    parameters and weight versions, to the bit, as through the transport."""
    staged = _pipelined(stages, microbatches, schedule, p2p="staged")
    linked = _pipelined(stages, microbatches, schedule, p2p="gloo")
    for (want, want_versions), (got, got_versions) in zip(staged, linked, strict=True):
        assert got_versions == want_versions
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_how_stages_are_linked_is_decided_together() -> None:
    def stage(ctx: Context) -> tuple[str, str]:
        kwargs = {"balance": _balance(2), "microbatches": 2, "optimizer": _optimizer, "context": ctx}
        pipe = Pipe(_layers(), loss_fn=nn.MSELoss(reduction="sum"), **kwargs)  # type: ignore[arg-type]
        auto = "host" if pipe.links is None else pipe.links[0].name
        with pytest.raises(ConfigError) as info:  # one stage asks for Gloo, the other for NCCL: every stage fails
            Pipe(_layers(), loss_fn=nn.MSELoss(), p2p="gloo" if ctx.rank else "nccl", **kwargs)  # type: ignore[arg-type]
        return auto, str(info.value)

    (auto0, error0), (auto1, error1) = run_ranks(2, stage, timeout=60)
    assert auto0 == auto1 == "host"  # CPU stages: through host memory
    assert error0 == error1 and "set it alike on every rank" in error0


def test_a_shape_mismatch_between_stages_fails_every_stage_without_a_hang() -> None:
    def stage(ctx: Context) -> None:
        layers: list[nn.Module] = [nn.Linear(4, 3, dtype=torch.float64), nn.Linear(5, 1, dtype=torch.float64)]
        pipe = Pipe(
            layers,
            balance=[1, 1],
            microbatches=2,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
        )
        pipe.step(torch.ones(4, 4, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.float64))

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        run_ranks(2, stage, timeout=60)


def test_auto_balance_profiles_on_stage_0_and_every_stage_agrees() -> None:
    def stage(ctx: Context) -> list[int]:
        layers: list[nn.Module] = [nn.Linear(64, 64, dtype=torch.float64) for _ in range(6)]
        sample = torch.ones(16, 64, dtype=torch.float64)
        pipe = Pipe(
            layers,
            balance="auto",
            sample=sample if ctx.rank == 0 else None,
            microbatches=2,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
        )
        return pipe.balance

    balances = run_ranks(3, stage, timeout=60)
    assert balances[0] == balances[1] == balances[2]
    assert sum(balances[0]) == 6 and min(balances[0]) >= 1


def _pipe_error(ctx: Context, layers: int, balance: list[int] | str) -> str:
    """The ConfigError a pipe of ``layers`` linear layers raises on this rank when built with ``balance``."""
    try:
        Pipe(
            [nn.Linear(2, 2) for _ in range(layers)],
            balance=balance,
            microbatches=1,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(),
            context=ctx,
        )
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_auto_balance_without_a_sample_fails_on_every_stage() -> None:
    messages = run_ranks(2, lambda ctx: _pipe_error(ctx, 2, "auto"), timeout=60)
    assert "needs sample=" in messages[0] and "could not profile" in messages[1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 3), (4, 2), (3, 8)])
def test_re_materialisation_changes_no_parameter(schedule: str, stages: int, microbatches: int) -> None:
    reference = _reference(microbatches)
    got = [p for params, _ in _pipelined(stages, microbatches, schedule, checkpoint=True) for p in params]
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=f"parameter {i}")


@pytest.mark.parametrize(
    ("schedule", "checkpoint", "expected"),
    [
        ("gpipe", False, [8 * 1024, 8 * 1536]),  # every micro-batch: its input and what its layers saved
        ("1f1b", False, [2 * 1024, 1 * 1536]),  # stage s holds K - s of them
        ("gpipe", True, [8 * 512, 8 * 512]),  # only the inputs
        ("1f1b", True, [2 * 512, 1 * 512]),
    ],
)
def test_activation_memory_held_per_stage(schedule: str, checkpoint: bool, expected: list[int]) -> None:
    """Two stages of two 16-wide float64 layers, 8 micro-batches of 4 rows: an activation is 512 bytes."""

    def stage(ctx: Context) -> int:
        layers: list[nn.Module] = [copy.deepcopy(layer) for layer in _SQUARE]
        pipe = Pipe(
            layers,
            balance=[2, 2],
            microbatches=8,
            schedule=schedule,
            checkpoint=checkpoint,
            context=ctx,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
        )
        pipe.step(torch.ones(32, 16, dtype=torch.float64), torch.zeros(32, 16, dtype=torch.float64))
        return pipe.peak_held_bytes

    assert run_ranks(2, stage, timeout=60) == expected


_SQUARE = [nn.Linear(16, 16, dtype=torch.float64) for _ in range(4)]


@pytest.mark.parametrize("p2p", ["staged", "gloo"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 1), (3, 4), (4, 8)])
def test_predict_equals_the_whole_model(stages: int, microbatches: int, p2p: str) -> None:
    x, _ = _batch(99)
    expected = nn.Sequential(*_layers())(x).detach().numpy()

    def stage(ctx: Context) -> np.ndarray | None:
        pipe = Pipe(
            _layers(),
            balance=_balance(stages),
            microbatches=microbatches,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            p2p=p2p,
        )
        out = pipe.predict(x if ctx.rank == 0 else None)
        pipe.step(*_batch(0))  # the tags of training after prediction stay matched
        return None if out is None else out.numpy()

    results = run_ranks(stages, stage, timeout=60)
    assert all(r is None for r in results[:-1])
    np.testing.assert_allclose(results[-1], expected, rtol=1e-13, atol=1e-13)


def _reference_replicated(replicas: int, microbatches: int) -> list[np.ndarray]:
    """One process on the R replicas' mini-batches together: every micro-batch's summed loss, one step."""
    model = nn.Sequential(*_layers())
    opt = _optimizer(list(model.parameters()))
    loss_fn = nn.MSELoss(reduction="sum")
    for step in range(STEPS):
        for r in range(replicas):
            x, y = _batch(10 * step + r)
            for xm, ym in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches), strict=True):
                loss_fn(model(xm), ym).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "replicas", "microbatches"), [(2, 2, 3), (3, 2, 2), (2, 3, 4), (1, 2, 2)])
def test_replicated_stages_equal_one_process_on_all_replicas_batches(
    schedule: str, stages: int, replicas: int, microbatches: int
) -> None:
    def worker(ctx: Context) -> tuple[int, int, list[np.ndarray]]:
        pipe = Pipe(
            _layers(),
            balance=_balance(stages),
            microbatches=microbatches,
            schedule=schedule,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            replicas=replicas,
        )
        for step in range(STEPS):
            x, y = _batch(10 * step + pipe.replica)
            pipe.step(x, y)
        return pipe.replica, pipe.stage_index, [p.detach().numpy().copy() for p in pipe.module.parameters()]

    results = run_ranks(stages * replicas, worker, timeout=120)
    assert [(r, s) for r, s, _ in results] == [(r, s) for r in range(replicas) for s in range(stages)]
    reference = _reference_replicated(replicas, microbatches)
    for replica in range(replicas):
        got = [p for r, _, params in results if r == replica for p in params]
        assert len(got) == len(reference)
        for i, (a, b) in enumerate(zip(got, reference, strict=True)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=f"replica {replica}, parameter {i}")


def test_replicas_must_divide_the_workers() -> None:
    def worker(ctx: Context) -> str:
        with pytest.raises(ConfigError, match="replicas=2 must divide the 3 workers"):
            Pipe(_layers(), balance=[8], microbatches=1, optimizer=_optimizer, context=ctx, replicas=2)
        return "refused"

    assert run_ranks(3, worker) == ["refused"] * 3


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_trace_spans_follow_the_schedule(schedule: str) -> None:
    """Every stage reports its steps' compute spans in the schedule's order, one after another, waits only for
    what it receives (activations: not stage 0; gradients: not the last stage; its sends at the end), and sends
    activations forward (not the last stage) and gradients back (not stage 0)."""

    def stage(ctx: Context) -> tuple[list[str], list[str], set[str], bool]:
        spans: list[tuple[str, str, float, float]] = []
        pipe = Pipe(
            _layers(),
            balance=_balance(3),
            microbatches=4,
            schedule=schedule,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            trace=lambda name, cat, t0, t1: spans.append((name, cat, t0, t1)),
        )
        x, y = _batch(0)
        pipe.step(x, y)
        names = {"F": "forward", "B": "backward"}
        expected = [f"{names[s.kind]} {s.microbatch}" if s.kind != "S" else "optimizer step" for s in pipe.steps]
        compute = [name for name, cat, _, _ in spans if cat == "compute"]
        waits = {
            name.rsplit(" ", 1)[0] if name[-1].isdigit() else name for name, cat, _, _ in spans if cat != "compute"
        }
        in_order = all(a[3] <= b[2] for a, b in itertools.pairwise(spans))
        return expected, compute, waits, in_order

    for rank, (expected, compute, waits, in_order) in enumerate(run_ranks(3, stage, timeout=60)):
        assert compute == expected, rank
        assert in_order, rank
        assert waits == {"wait sends"} | ({"wait activation", "send gradient"} if rank > 0 else set()) | (
            {"wait gradient", "send activation"} if rank < 2 else set()
        ), rank


def test_vertical_sync_runs_each_micro_batch_on_the_weights_of_its_version() -> None:
    """Not only the recorded numbers: with vertical sync, stage 1's forward of micro-batch 2 (K = 2, M = 3) runs on
    stage 1's weights of version 1 (after its first step), although the stage holds version 2 by then; its output
    is what those weights give, and the stashed copy is what the backward differentiates."""
    seen: dict[int, list[torch.Tensor]] = {}

    def stage(ctx: Context) -> list[tuple[str, int, int]]:
        pipe = Pipe(
            _layers(),
            balance=[4, 4],
            microbatches=3,
            schedule="pipedream-vsync",
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
        )
        if ctx.rank == 1:  # the weights of every version stage 1 goes through, and what each forward ran on
            original = pipe._forward

            def spy(inp: torch.Tensor, params: dict[str, torch.Tensor] | None, target: torch.Tensor | None):
                assert params is not None
                seen.setdefault(len(seen), [t.detach().clone() for t in params.values()])
                return original(inp, params, target)

            pipe._forward = spy  # type: ignore[method-assign]
            snapshots = [[p.detach().clone() for p in pipe.module.parameters()]]
            opt_step = pipe._apply_gradients

            def record(trace: object) -> None:
                opt_step(None)
                snapshots.append([p.detach().clone() for p in pipe.module.parameters()])

            pipe._apply_gradients = record  # type: ignore[method-assign,assignment]
        x, y = _batch(0)
        pipe.step(x, y)
        if ctx.rank == 1:
            used = [[t.numpy() for t in seen[i]] for i in range(3)]
            want = [snapshots[v] for _, _, v in [e for e in pipe.versions if e[0] == "F"]]
            for got, expected in zip(used, want, strict=True):
                for a, b in zip(got, expected, strict=True):
                    np.testing.assert_array_equal(a, b.numpy())
        return pipe.versions

    versions = run_ranks(2, stage, timeout=60)
    assert [v for k, _, v in versions[1] if k == "F"] == [0, 0, 1]  # stage 0's versions, not stage 1's 0, 1, 2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_first_stage_without_parameters_trains_as_one_process(schedule: str) -> None:
    """A stage of only parameterless modules in front (a Flatten, as the planner's split of mlp gives) learns
    nothing: no gradient goes back to it, it runs no backward, and the model trains as one process. Every stage
    sends exactly the bytes of the plan the simulator replays (:func:`lower` with ``first_learner``)."""
    reference = _reference(2)

    def stage(ctx: Context) -> tuple[list[np.ndarray], tuple[int, int], int]:
        pipe = Pipe(
            [nn.Identity(), *_layers()],
            balance=[1, 4, 4],
            microbatches=2,
            schedule=schedule,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
        )
        stats = ctx.transport.stats
        before = (stats.messages_sent, stats.bytes_sent)
        for step in range(STEPS):
            x, y = _batch(step)
            pipe.step(x, y)
        params = [p.detach().numpy().copy() for p in pipe.module.parameters()]
        sent = (stats.messages_sent - before[0], stats.bytes_sent - before[1])
        return params, sent, pipe.gradient_from

    results = run_ranks(3, stage, timeout=120)
    got = [p for params, _, _ in results for p in params]
    assert len(got) == len(reference)
    for a, b in zip(got, reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert [first for _, _, first in results] == [1, 1, 1]
    micro = BATCH // 2 * 8  # float64 rows of a micro-batch
    plan = lower(pipeline_schedule(schedule, 3, 2), activation_bytes=[micro * IN, micro * 6, 0], first_learner=1)
    # every message of the plan the simulator replays, and no other: the same count and bytes on every stage
    want = [(STEPS * len(plan.sends(s)), STEPS * sum(m.nbytes for m in plan.sends(s))) for s in range(3)]
    assert [sent for _, sent, _ in results] == want
    assert [m.nbytes for m in plan.sends(1) if m.dst == 0] == [0]  # no gradient back to stage 0: the step's end


def test_device_per_stage_moves_the_layers_and_must_name_every_stage() -> None:
    """``device=`` (one per stage) is where a stage computes; its inputs and targets follow (CPU here: the CUDA
    twins are in tests/cuda)."""
    x, y = _batch(0)

    def stage(ctx: Context) -> tuple[str, float | None]:
        with pytest.raises(ConfigError, match="names 3 devices for 2 stages"):
            Pipe(_layers(), balance=_balance(2), microbatches=2, optimizer=_optimizer, context=ctx,
                 loss_fn=nn.MSELoss(reduction="sum"), device=["cpu"] * 3)  # fmt: skip
        pipe = Pipe(
            _layers(),
            balance=_balance(2),
            microbatches=2,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            device=["cpu", torch.device("cpu")],
        )
        return str(pipe.device), pipe.step(x, y)

    (d0, none), (d1, loss) = run_ranks(2, stage, timeout=60)
    assert (d0, d1, none) == ("cpu", "cpu", None) and loss is not None and loss > 0


def test_a_replacement_stage_takes_the_balance_the_others_hold_and_never_profiles() -> None:
    def stage(ctx: Context) -> list[int]:
        replacement = ctx.rank == 0  # stage 0, which would profile for "auto", replaces a dead one: no sample
        pipe = Pipe(
            [nn.Linear(4, 4, dtype=torch.float64) for _ in range(3)],
            balance="auto" if replacement else [2, 1],
            rejoin=replacement,
            microbatches=1,
            optimizer=_optimizer,
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
        )
        return pipe.balance

    assert run_ranks(2, stage, timeout=60) == [[2, 1], [2, 1]]


def test_stages_given_different_balances_fail_together() -> None:
    messages = run_ranks(2, lambda ctx: _pipe_error(ctx, 3, [2, 1] if ctx.rank == 0 else [1, 2]), timeout=60)
    assert all("given different balances" in m for m in messages)
