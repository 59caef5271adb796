"""A pipeline step sends and receives exactly its lowered plan: every message, in order, with the plan's tags.

Each stage's transport is wrapped in a recorder of sends and receives while :meth:`Pipe.step` runs; per rank,
the record (kind, peer, tag below the step's first tag, bytes sent) must equal the ``send`` and ``recv`` actions
of :func:`~paratrain.pipeline.schedules.lower` of the schedule, with the runtime's activation sizes: the plan
the simulator replays.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.pipeline.schedules import done_tag, gradient_from, lower, schedule
from paratrain.plan.ir import Plan
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.torch.pipeline import Pipe
from paratrain.transport.base import ANY_SOURCE, ANY_TAG, Handle, Transport
from paratrain.transport.recording import RecordingTransport
from paratrain.transport.wire import Message

BATCH, MICRO, STEPS = 8, 4, 2
WIDTHS = [5, 6, 6, 3]  # the Linear layers' sizes: in 5, then 6, 6, out 3
Event = tuple[str, int, int, int]  # (kind, peer, tag, bytes sent; 0 for a receive)


class _Recorder(RecordingTransport):
    """Records receives as well as sends, in the order the stage makes them."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.events: list[Event] = []
        self._order = threading.Lock()

    def isend(
        self, dst: int, tag: int, arrays: Sequence[Any] = (), meta: Mapping[str, Any] | None = None
    ) -> Handle[None]:
        with self._order:
            handle = super().isend(dst, tag, arrays, meta)
            self.events.append(("send", dst, tag, self.sent[-1].nbytes))
        return handle

    def irecv(self, src: int = ANY_SOURCE, tag: int = ANY_TAG) -> Handle[Message]:
        with self._order:
            self.events.append(("recv", src, tag, 0))
        return super().irecv(src, tag)


def _build() -> list[nn.Module]:
    torch.manual_seed(5)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b, dtype=torch.float64), nn.Tanh()]
    return layers


_TEMPLATE = _build()  # built once: threads must not share torch's global generator while seeding


def _layers(front: bool) -> list[nn.Module]:
    """A fresh copy of the model; with ``front``, a parameterless module in front of it."""
    layers = copy.deepcopy(_TEMPLATE)
    return [nn.Identity(), *layers] if front else layers


def _balance(stages: int, front: bool) -> list[int]:
    """Layers per stage: with ``front``, stage 0 holds the parameterless Identity alone."""
    if front:
        return {3: [1, 2, 4]}[stages]
    return {2: [2, 4], 3: [2, 2, 2]}[stages]


def _run(name: str, stages: int, front: bool) -> list[tuple[list[list[Event]], Plan]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTHS[0], generator=gen, dtype=torch.float64)
    y = torch.randn(BATCH, WIDTHS[-1], generator=gen, dtype=torch.float64)

    def stage(ctx: Context) -> tuple[list[list[Event]], Plan]:
        pipe = Pipe(
            _layers(front),
            balance=_balance(stages, front),
            microbatches=MICRO,
            schedule=name,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
            loss_fn=nn.MSELoss(reduction="sum"),
            context=ctx,
            p2p="staged",
        )
        rec = _Recorder(pipe.group.transport)
        pipe.group.transport = rec
        steps = []
        for _ in range(STEPS):
            base = pipe.group.reserve_tags(1) - 1  # every stage reserves alike: the step's first tag is the next
            pipe.step(x, y)
            steps.append([(kind, peer, base - tag, nbytes) for kind, peer, tag, nbytes in rec.events])
            rec.events.clear()
        return steps, pipe.plan

    return run_ranks(stages, stage, timeout=120)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream", "pipedream-vsync"])
@pytest.mark.parametrize(("stages", "front"), [(2, False), (3, False), (3, True)])
def test_a_pipeline_step_sends_and_receives_its_lowered_plan(name: str, stages: int, front: bool) -> None:
    results = _run(name, stages, front)
    rows = BATCH // MICRO
    layers = _layers(front)
    cuts = [sum(_balance(stages, front)[: s + 1]) for s in range(stages)]
    widths = [  # each stage's output width: its last Linear's, or its input's for a parameterless stage
        next((m.out_features for m in reversed(layers[:cut]) if isinstance(m, nn.Linear)), WIDTHS[0]) for cut in cuts
    ]
    first = gradient_from([s > 0 or not front for s in range(stages)])
    sched = schedule(name, stages, MICRO)
    plan = lower(sched, activation_bytes=[rows * w * 8 for w in widths[:-1]] + [0], first_learner=first)
    plan.validate()
    for s, (steps, executed) in enumerate(results):
        assert executed == lower(sched, first_learner=first), "the runtime executes the lowered schedule"
        want = [
            (a.kind, a.peer, a.tag, a.nbytes if a.kind == "send" else 0)
            for a in plan.ranks[s]
            if a.kind in ("send", "recv")
        ]
        assert want, f"stage {s} has messages"
        for got in steps:
            assert got == want, f"stage {s}"
    if front:  # stage 0 learns nothing: no gradient to it, only the empty message that ends its step
        assert [e for e in results[0][0][0] if e[0] == "recv"] == [("recv", 1, done_tag(MICRO), 0)]
