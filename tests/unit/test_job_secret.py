"""The job secret: parsed and validated once, keys derived alike on every rank, given to every launched process,
refused-to-run-without, and refusals logged without flooding."""

from __future__ import annotations

import logging

import pytest

from paratrain.config import Settings, parse_secret
from paratrain.errors import ConfigError
from paratrain.launch.env import child_environments
from paratrain.launch.kills import ENV as KILL_ENV
from paratrain.launch.plan import LaunchPlan
from paratrain.launch.procs import ProcSpec
from paratrain.launch.restarts import Restarts, spare_spec
from paratrain.transport.auth import JobKeys, RefusalLog, new_secret
from paratrain.transport.registry import connect, job_secret

HEX = "ab" * 32
JOB = {"RANK": "1", "WORLD_SIZE": "2"}


def test_the_secret_comes_from_the_environment_in_hex_and_never_shows_in_repr() -> None:
    settings = Settings.from_env({**JOB, "PARATRAIN_SECRET": HEX})
    assert settings.secret == bytes.fromhex(HEX)
    assert HEX not in repr(settings) and "secret" not in repr(settings)
    assert Settings.from_env(JOB).secret is None
    assert Settings.from_env({**JOB, "PARATRAIN_SECRET": "  "}).secret is None  # empty: not set


@pytest.mark.parametrize(
    ("value", "match"),
    [("not-hex", "not hex"), ("abc", "not hex"), ("ab" * 15, "15 bytes, fewer than 16")],
)
def test_a_bad_secret_is_refused_with_how_to_make_one(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        Settings.from_env({**JOB, "PARATRAIN_SECRET": value})
    assert "secrets.token_hex(32)" in str(info.value)


def test_insecure_is_a_flag() -> None:
    assert Settings.from_env({**JOB, "PARATRAIN_INSECURE": "1"}).insecure
    assert not Settings.from_env({**JOB, "PARATRAIN_INSECURE": "0"}).insecure
    with pytest.raises(ConfigError, match="must be 1 or 0"):
        Settings.from_env({**JOB, "PARATRAIN_INSECURE": "yes"})
    with pytest.raises(ConfigError, match="fewer than 16"):
        Settings(secret=b"short")


def test_a_job_of_several_processes_without_a_secret_refuses_to_start_and_says_how() -> None:
    with pytest.raises(ConfigError) as info:
        connect(Settings(rank=0, world_size=2))  # refused before any socket is opened or any peer awaited
    text = str(info.value)
    assert "PARATRAIN_SECRET" in text and "export PARATRAIN_SECRET=" in text and "PARATRAIN_INSECURE=1" in text


def test_the_opt_out_warns_and_a_secret_beats_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="paratrain.transport"):
        assert job_secret(Settings(rank=0, world_size=2, insecure=True)) is None
        assert "not authenticated" in caplog.text
        caplog.clear()
        assert job_secret(Settings(rank=0, world_size=2, insecure=True, secret=b"s" * 16)) == b"s" * 16
        assert "PARATRAIN_INSECURE=1 is ignored" in caplog.text


def test_keys_are_derived_alike_from_one_secret_and_apart_from_another() -> None:
    secret = new_secret()
    a, b, other = JobKeys.derive(secret), JobKeys.derive(bytes(secret)), JobKeys.derive(new_secret())
    assert a == b
    assert len({a.server_public, a.client_public, other.server_public, other.client_public}) == 4
    assert len(a.server_public) == 40  # Z85 of 32 bytes
    assert a.server_secret.decode() not in repr(a) and a.client_secret.decode() not in repr(a)
    # the ipc password is per endpoint: one leaked to an impostor opens no other endpoint
    assert a.ipc_password("ipc://@x-1") == b.ipc_password("ipc://@x-1") != a.ipc_password("ipc://@x-2")
    assert a.ipc_password("ipc://@x-1") != other.ipc_password("ipc://@x-1")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        JobKeys.derive(b"short")


def test_parse_secret_accepts_any_case_and_surrounding_space() -> None:
    assert parse_secret(f" {HEX.upper()}\n") == bytes.fromhex(HEX)


def _spec(env: dict[str, str]) -> ProcSpec:
    return ProcSpec(name="rank 1", argv=["true"], env=env, prefix="[rank1]: ")


def test_every_launched_process_gets_the_job_secret_spares_and_restarts_too() -> None:
    plan = LaunchPlan(
        nproc=2, argv=["x"], run_id="r", master_port=1, rdzv_port=2, scratch_dir="/tmp/x", servers=1, secret=HEX
    )
    assert HEX not in repr(plan)
    envs = child_environments(plan, {"PARATRAIN_SECRET": "cd" * 32, "PATH": "/bin"})  # the shell's is replaced
    assert [e["PARATRAIN_SECRET"] for e in envs] == [HEX] * 3
    spare = spare_spec(_spec(envs[0]), prefix=True)
    assert spare.env["PARATRAIN_SECRET"] == HEX
    replacement = Restarts(budget=1).replacement(_spec({**envs[1], KILL_ENV: "1@step=3"}))
    assert replacement is not None and replacement.env["PARATRAIN_SECRET"] == HEX
    assert b'"PARATRAIN_SECRET": "' + HEX.encode() + b'"' in Restarts.assignment(replacement)


def test_refusals_are_logged_first_at_once_then_once_per_interval_with_the_count_held_back() -> None:
    now = [0.0]
    lines: list[str] = []
    refusals = RefusalLog(lines.append, interval=10.0, clock=lambda: now[0])
    for t in (0.0, 0.1, 0.2, 5.0):  # a flood: one line, three held back
        now[0] = t
        refusals.refused(f"refused at {t}")
    assert lines == ["refused at 0.0"] and refusals.held == 3
    now[0] = 9.0
    assert refusals.due_in() == pytest.approx(1.0)
    now[0] = 10.5  # the guard's timer: the count of those held back, then nothing is pending
    refusals.flush("rank 1")
    assert lines[-1] == "rank 1: 3 more connections refused in the last 10s" and refusals.due_in() is None
    now[0] = 12.0  # within the interval of the summary: held again
    refusals.refused("refused at 12")
    now[0] = 30.0
    refusals.refused("refused at 30")
    assert lines[-1] == "refused at 30 (and 1 more refusals in the last 20s)"
    refusals.flush("rank 1")  # nothing held: nothing written
    assert len(lines) == 3
