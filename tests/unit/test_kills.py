"""Kill schedules: every form parses to exactly the failure it names, bad schedules are refused before anything
starts, random items are reproducible from the seed, and a step kill fires at its step and nowhere else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from paratrain.errors import ConfigError
from paratrain.launch.kills import ENV, Kill, kill_env, parse_kills, time_kill


def test_every_form_parses_to_the_failure_it_names() -> None:
    kills = parse_kills("1@step=5, 0@2.5s:TERM, server1@1s:9, 2@step=1:SIGINT", nproc=3, servers=2)
    assert kills == [
        Kill("rank", 1, 5, None, int(signal.SIGKILL), "1@step=5"),
        Kill("rank", 0, None, 2.5, int(signal.SIGTERM), "0@2.5s:TERM"),
        Kill("server", 1, None, 1.0, 9, "server1@1s:9"),
        Kill("rank", 2, 1, None, int(signal.SIGINT), "2@step=1:SIGINT"),
    ]
    assert kill_env(kills, "rank", 1) == {ENV: f"5:{int(signal.SIGKILL)}:1@step=5"}
    assert kill_env(kills, "rank", 0) == {} and kill_env(kills, "server", 1) == {}
    assert time_kill(kills, "rank", 0) == (
        2.5,
        int(signal.SIGTERM),
        "SIGTERM to rank 0 2.5 s after the start (--kill 0@2.5s:TERM)",
    )
    assert time_kill(kills, "rank", 1) is None
    assert parse_kills("", nproc=2) == []


def test_random_items_are_drawn_from_the_seed() -> None:
    def draw(seed: int) -> list[tuple[int, int | None]]:
        return [(k.index, k.step) for k in parse_kills("random@step=2-40,random@step=7-7", nproc=4, seed=seed)]

    assert draw(3) == draw(3)
    first = [draw(seed)[0] for seed in range(20)]
    assert len(set(first)) > 5  # different seeds, different kills
    assert all(0 <= rank < 4 and 2 <= step <= 40 for rank, step in first if step is not None)
    assert {step for _, step in (draw(seed)[1] for seed in range(20))} == {7}
    assert all(draw(seed)[0][0] != draw(seed)[1][0] for seed in range(20))  # never the same worker twice
    with pytest.raises(ConfigError, match="every worker is already killed"):
        parse_kills("0@step=1,random@step=1-3", nproc=1)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("1@later", "write RANK@step=K"),
        ("2@step=3", "the job has 2 worker(s), ranks 0..1"),
        ("server0@1s", "the job has 0 server(s)"),
        ("server0@step=3", "servers have no steps"),
        ("1@step=0", "steps count from 1"),
        ("random@step=9-3", "A <= B"),
        ("1@step=2-5", "a step range is for random"),
        ("random@2s", "random kills are of steps"),
        ("1@step=2:NOPE", "unknown signal 'NOPE'"),
        ("1@step=2,1@3s", "rank 1 is killed more than once"),
    ],
)
def test_bad_schedules_are_refused_with_what_to_write(schedule: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_kills(schedule, nproc=2, servers=1 if schedule.startswith("server0@step") else 0)


def test_a_step_kill_fires_at_its_step_and_not_before() -> None:
    script = (
        "from paratrain.launch.kills import kill_point\n"
        "for step in range(1, 6):\n"
        "    kill_point(step)\n"
        "    print('step', step, flush=True)\n"
    )
    env = {**os.environ, ENV: f"3:{int(signal.SIGKILL)}:0@step=3"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == -signal.SIGKILL
    assert out.stdout.split("\n")[:-1] == ["step 1", "step 2"]
    assert "injected fault: SIGKILL at step 3 (--kill 0@step=3)" in out.stderr
    env.pop(ENV)
    clean = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert clean.returncode == 0 and clean.stdout.count("step") == 5
