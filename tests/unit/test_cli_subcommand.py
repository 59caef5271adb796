"""A command that runs another (``bench sched``, ``plan --run``) does it through that command's module alone."""

from __future__ import annotations

import pytest

from paratrain.cli import topology
from paratrain.cli.subcommand import parse_subcommand, run_subcommand


def test_a_subcommand_runs_as_paratrain_would_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_subcommand(topology, ["topology", "ring", "--workers", "4"]) == 0
    assert "spectral gap" in capsys.readouterr().out


def test_a_bad_argument_exits_as_paratrain_would() -> None:
    with pytest.raises(SystemExit) as info:
        parse_subcommand(topology, ["topology", "ring", "--workers", "four"])
    assert info.value.code == 2
