"""The examples in the plan modules' docstrings run: they are the exact tables a reader checks first."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "paratrain.plan.ir",
    "paratrain.plan.cost",
    "paratrain.collectives.plans",
    "paratrain.collectives.lower",
    "paratrain.collectives.lower_shm",
    "paratrain.collectives.policy",
    "paratrain.ps.plans",
    "paratrain.gossip.plan",
    "paratrain.pipeline.schedules",
    "paratrain.pipeline.partition",
    "paratrain.torch.profile",
    "paratrain.strategy.spec",
    "paratrain.transport.recording",
    "paratrain.runtime.group",
    "paratrain.fusion.buckets",
    "paratrain.sim.machine",
    "paratrain.sim.engine",
    "paratrain.sim.step",
    "paratrain.compression.compressors",
    "paratrain.collectives.shm",
    "paratrain.bench.simulator",
    "paratrain.bench.profile",
    "paratrain.sim.pipe",
    "paratrain.sched.graph",
    "paratrain.sched.coloring",
    "paratrain.sched.chromatic",
    "paratrain.sched.strads",
    "paratrain.sched.lasso",
    "paratrain.sched.mf",
    "paratrain.collectives.engine",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
