"""A worker's push, clock and pull send exactly the plan's messages, with or without replicas.

Each worker's transport records what it sends; with every primary alive, a push, a clock and a pull of a key must
send, in order, the requests of :func:`~paratrain.ps.plans.push_actions`, :func:`~paratrain.ps.plans.clock_actions`
and :func:`~paratrain.ps.plans.pull_actions` (peer, bytes, tag), whatever the number of replicas: the replicas'
work (notices, states, forwards) is between servers, and the worker's single path iterates the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from paratrain.config import Settings
from paratrain.plan.ir import Action
from paratrain.ps.client import KVStore
from paratrain.ps.plans import REQUEST, clock_actions, pull_actions, push_actions
from paratrain.ps.protocol import REQUEST_TAG
from paratrain.ps.sharding import as_rows, plan_chunks
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.transport.recording import RecordingTransport

SHAPE = (40, 3)
CHUNK_BYTES = 64  # 2 rows of 3 float64 per chunk: 20 chunks, batched per server


@dataclass
class _RecordedWorker:
    """A worker context whose transport records (what a KVStore needs: settings, transport, rank)."""

    settings: Settings
    transport: RecordingTransport
    rank: int


def _sends(actions: tuple[Action, ...]) -> list[tuple[int, int, int]]:
    """The (peer, bytes, tag) of each send of ``actions``, their symbolic request tag as the runtime's."""
    assert all(a.tag == REQUEST for a in actions if a.kind == "send")
    return [(a.peer, a.nbytes, REQUEST_TAG) for a in actions if a.kind == "send"]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize(("servers", "replicas"), [(1, 1), (2, 1), (2, 2)])
def test_push_clock_and_pull_send_the_plan_for_any_number_of_replicas(
    workers: int, servers: int, replicas: int
) -> None:
    def fn(ctx: Context) -> tuple[list[list[tuple[int, int, int]]], np.ndarray]:
        rec = RecordingTransport(ctx.transport)
        # SSP(1): a clock never waits (no wait_clock request) and a replicated push is acknowledged after the clock
        kv = KVStore(
            "ssp", 1, context=_RecordedWorker(ctx.settings, rec, ctx.rank), chunk_bytes=CHUNK_BYTES, replicas=replicas
        )
        kv.init("w", np.zeros(SHAPE))
        rec.take()  # init is not part of the round
        steps = []
        handle = kv.push("w", np.ones(SHAPE))
        steps.append([(m.dst, m.nbytes, m.tag) for m in rec.take()])
        kv.clock()
        steps.append([(m.dst, m.nbytes, m.tag) for m in rec.take()])
        handle.wait(30)
        assert not rec.take(), "waiting for a push after the clock sends nothing"
        out = kv.pull("w")
        steps.append([(m.dst, m.nbytes, m.tag) for m in rec.take()])
        kv.close()
        return steps, out

    results = run_ranks(workers, fn, servers=servers, timeout=60)
    _, cols = as_rows(SHAPE)
    row_bytes = cols * 8
    chunks = plan_chunks("w", SHAPE, 8, servers, chunk_bytes=CHUNK_BYTES, replicas=replicas)
    ranks = [workers + s for s in range(servers)]
    planned = [
        _sends(push_actions(chunks, row_bytes, ranks)),
        _sends(clock_actions(ranks)),
        _sends(pull_actions(chunks, row_bytes, ranks)),
    ]
    assert len(planned[0]) == len({c.server for c in chunks}) and len(planned[1]) == servers
    for rank, (steps, out) in enumerate(results):
        assert steps == planned, f"worker {rank}"
        # its own push at least, and under SSP(1) perhaps not yet the others'
        assert ((out >= 1) & (out <= workers)).all(), f"worker {rank}"
