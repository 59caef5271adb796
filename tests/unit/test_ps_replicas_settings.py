"""The ``replicas`` setting of the parameter server, without processes: environment, validation, train's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import paratrain.launch.run
from paratrain.cli.main import main
from paratrain.config import Settings
from paratrain.errors import ConfigError


def _env(**extra: str) -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "2", "PARATRAIN_NUM_SERVERS": "2", **extra}


def test_ps_replicas_comes_from_the_environment_and_defaults_to_one() -> None:
    assert Settings.from_env(_env()).ps_replicas == 1
    assert Settings.from_env(_env(PARATRAIN_PS_REPLICAS="2")).ps_replicas == 2


@pytest.mark.parametrize("value", ["0", "3"])
def test_ps_replicas_outside_one_to_the_servers_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="PARATRAIN_PS_REPLICAS"):
        Settings.from_env(_env(PARATRAIN_PS_REPLICAS=value))


def test_launch_refuses_more_replicas_than_servers() -> None:
    with pytest.raises(ConfigError, match="--replicas 3"):
        paratrain.launch.run.run_launch(["true"], nproc=1, servers=2, replicas=3)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--strategy", "bsp", "--servers", "1", "--replicas", "2"], "--replicas 2"),
        (["--strategy", "allreduce", "--replicas", "2"], "--replicas is for pipelines"),
    ],
)
def test_train_checks_replicas_before_starting(
    argv: list[str], error: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_launch(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("no process may start")

    monkeypatch.setattr(paratrain.launch.run, "run_launch", no_launch)
    assert main(["train", "--epochs", "1", *argv]) == 2
    assert error in capsys.readouterr().err


def test_train_passes_replicas_to_the_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def fake_launch(cmd: list[str], **kwargs: Any) -> int:
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(paratrain.launch.run, "run_launch", fake_launch)
    with pytest.raises(SystemExit):
        main(
            [
                "train",
                "--epochs",
                "1",
                "--strategy",
                "bsp",
                "--servers",
                "2",
                "--replicas",
                "2",
                "--run-dir",
                str(tmp_path),
            ]
        )
    assert seen["servers"] == 2 and seen["replicas"] == 2
