"""Tests of Settings.from_env and its helpers; environments are injected as dicts, never os.environ."""

from __future__ import annotations

import pytest

from paratrain.config import DEFAULT_MASTER_PORT, Settings, first_host_of_nodelist, host_id, parse_duration
from paratrain.errors import ConfigError

TORCHRUN_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job-42",
}

SLURM_ENV = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "node[07-10,12]",
}


def test_empty_env_is_a_single_process() -> None:
    s = Settings.from_env({})
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size) == (0, 1, 0, 1)
    assert s.launched_by == "none"
    assert (s.master_addr, s.master_port, s.rdzv_port) == ("127.0.0.1", DEFAULT_MASTER_PORT, DEFAULT_MASTER_PORT + 1)
    assert s.transport == "zmq"
    assert s.role == "worker"
    assert s.run_id == "default"
    assert not s.rdzv_hosted
    assert s.faults is None


def test_torchrun_env() -> None:
    s = Settings.from_env(TORCHRUN_ENV)
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size) == (3, 8, 1, 2)
    assert (s.master_addr, s.master_port) == ("10.0.0.5", 29400)
    # paratrain's rendezvous sits next to torch's store, which owns MASTER_PORT itself.
    assert (s.rdzv_addr, s.rdzv_port) == ("10.0.0.5", 29401)
    assert s.launched_by == "torchrun"
    assert s.run_id == "job-42"
    assert not s.rdzv_hosted


def test_paratrain_launch_env() -> None:
    env = {
        **TORCHRUN_ENV,
        "PARATRAIN_LAUNCHER": "1",
        "PARATRAIN_RUN_ID": "pt-run",
        "PARATRAIN_RDZV_PORT": "31000",
        "PARATRAIN_RDZV_HOSTED": "1",
    }
    s = Settings.from_env(env)
    assert s.launched_by == "paratrain"
    assert s.rdzv_hosted
    assert s.rdzv_port == 31000
    # The launcher's run id wins over the torch elastic one.
    assert s.run_id == "pt-run"
    assert (s.rank, s.world_size) == (3, 8)


def test_slurm_env() -> None:
    s = Settings.from_env(SLURM_ENV)
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size) == (5, 8, 1, 4)
    # Rank 0 runs on the first host of the node list, so the rendezvous is found there.
    assert s.master_addr == "node07"
    assert s.rdzv_addr == "node07"
    assert s.launched_by == "slurm"


def test_slurm_ntasks_per_node_takes_precedence() -> None:
    s = Settings.from_env({**SLURM_ENV, "SLURM_NTASKS_PER_NODE": "2"})
    assert s.local_world_size == 2


def test_slurm_master_addr_overrides_nodelist() -> None:
    s = Settings.from_env({**SLURM_ENV, "MASTER_ADDR": "head.example"})
    assert s.master_addr == "head.example"
    assert s.launched_by == "slurm"


def test_explicit_rank_wins_over_slurm() -> None:
    s = Settings.from_env({**SLURM_ENV, "RANK": "2", "WORLD_SIZE": "3"})
    assert (s.rank, s.world_size) == (2, 3)
    assert s.launched_by != "slurm"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node07", "node07"),
        ("node[07-10,12],gpu3", "node07"),
        ("gpu3,node[1-2]", "gpu3"),
        ("rack1-n[003-004]", "rack1-n003"),  # the dash in the prefix is not a range
        ("a[1,3]b", "a1b"),  # a suffix after the brackets is kept
    ],
)
def test_first_host_of_nodelist(nodelist: str, first: str) -> None:
    assert first_host_of_nodelist(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "bad["])
def test_first_host_of_nodelist_rejects(nodelist: str) -> None:
    with pytest.raises(ConfigError):
        first_host_of_nodelist(nodelist)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2ms", 0.002), ("1.5s", 1.5), ("300", 300.0), ("500us", 5e-4), ("2min", 120.0), (" 3 s ", 3.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["abc", "-1s", "", "5 parsecs"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_duration(text)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "1"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"PARATRAIN_TRANSPORT": "carrier-pigeon"}, r"carrier-pigeon.*zmq, inproc"),
        ({"PARATRAIN_ROLE": "boss"}, r"boss.*worker, server"),
        ({"PARATRAIN_TIMEOUT": "0"}, "PARATRAIN_TIMEOUT"),
        ({"PARATRAIN_TIMEOUT": "soon"}, "PARATRAIN_TIMEOUT"),
        ({"PARATRAIN_HEARTBEAT": "5", "PARATRAIN_HEARTBEAT_TIMEOUT": "2"}, "heartbeat_timeout"),
        ({"MASTER_PORT": "70000"}, "70000"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT"),
        ({**SLURM_ENV, "SLURM_JOB_NODELIST": ""}, "MASTER_ADDR"),
    ],
    ids=[
        "rank-without-world",
        "world-without-rank",
        "rank-equals-world",
        "rank-not-int",
        "unknown-transport",
        "unknown-role",
        "zero-timeout",
        "timeout-not-duration",
        "heartbeat-timeout-below-interval",
        "port-out-of-range",
        "port-not-int",
        "slurm-without-nodelist",
    ],
)
def test_invalid_env_raises_config_error(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        Settings.from_env(env)
    # Callers that only know ValueError still catch it.
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0", "MASTER_ADDR": "h"}, "world size"),
        ({"MASTER_PORT": "0"}, "master_port"),
        ({"PARATRAIN_RDZV_PORT": "0"}, "rdzv_port"),
    ],
    ids=["world-size", "slurm-ntasks", "master-port", "rdzv-port"],
)
def test_explicit_zero_is_rejected_not_defaulted(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings.from_env(env)


def test_settings_constructor_rejects_world_size_zero() -> None:
    with pytest.raises(ConfigError, match="world size"):
        Settings(world_size=0)


def test_host_id_env_override() -> None:
    assert host_id({"PARATRAIN_HOST_ID": "rack3"}) == "rack3"
    assert Settings.from_env({"PARATRAIN_HOST_ID": "rack3"}).host_id == "rack3"


def test_host_id_is_stable_within_a_process() -> None:
    first = host_id({})
    assert first
    assert host_id({}) == first


def test_replace_validates_again() -> None:
    s = Settings.from_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert s.replace(rank=0).rank == 0
    with pytest.raises(ConfigError, match="rank 9"):
        s.replace(rank=9)
