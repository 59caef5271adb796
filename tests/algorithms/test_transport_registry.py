"""Transports are created by name from one registry; a registered kind becomes a valid PARATRAIN_TRANSPORT."""

from __future__ import annotations

import numpy as np
import pytest

from paratrain.config import Settings
from paratrain.errors import ConfigError
from paratrain.runtime.context import Context
from paratrain.testing import run_ranks
from paratrain.transport.inproc import InprocFabric
from paratrain.transport.recording import RecordingTransport
from paratrain.transport.registry import LocalJob, TransportKind, connect, kinds, register_transport


def _recording_local(world_size: int, timeout: float) -> LocalJob:
    fabric = InprocFabric(world_size, timeout=timeout)
    return LocalJob([RecordingTransport(fabric.transport(r)) for r in range(world_size)], fabric.fail_all)


def _recording_connect(settings: Settings, fabric: object | None) -> RecordingTransport:
    raise ConfigError("the recording test transport runs in-process only")


if "recording-test" not in kinds():
    register_transport(TransportKind("recording-test", "inproc, recorded", _recording_connect, _recording_local))


def test_a_registered_transport_runs_a_job_and_is_a_valid_setting() -> None:
    def fn(ctx: Context) -> tuple[float, int]:
        total = float(ctx.allreduce(np.ones(4), algorithm="ring")[0])
        assert isinstance(ctx.transport, RecordingTransport)
        return total, len(ctx.transport.sent)

    results = run_ranks(3, fn, transport="recording-test")
    assert [r[0] for r in results] == [3.0, 3.0, 3.0]
    assert all(r[1] > 0 for r in results)
    assert Settings.from_env({"PARATRAIN_TRANSPORT": "recording-test"}).transport == "recording-test"


def test_unknown_names_list_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'; choose one of zmq, inproc"):
        run_ranks(2, lambda ctx: None, transport="carrier-pigeon")
    with pytest.raises(ConfigError, match="in-process only"):
        connect(Settings(world_size=2, rank=0, transport="recording-test"))
