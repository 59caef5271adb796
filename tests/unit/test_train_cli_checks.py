"""`paratrain train`/`compare` without processes: the up-front check of the 'train' extra, the epoch lines."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest

import paratrain.launch.run
import paratrain.train.extra
import paratrain.train.run
from paratrain.cli.main import main


def _no_launch(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("no worker may start when the 'train' extra is missing")


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_missing_train_extra_is_said_once_before_any_worker_starts(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The story: without scikit-learn every rank died with its own ModuleNotFoundError traceback."""
    monkeypatch.setattr(paratrain.train.extra, "missing_train_extra", lambda: ["scikit-learn"])
    monkeypatch.setattr(paratrain.launch.run, "run_launch", _no_launch)
    assert main([command, "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    message = f"paratrain {command} needs the 'train' extra: pip install 'paratrain[train]' (missing: scikit-learn)"
    assert err.strip() == message


def test_missing_train_extra_names_the_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("sklearn", "tqdm") else real(name, *a)
    )
    missing = paratrain.train.extra.missing_train_extra()
    assert "scikit-learn" in missing and "tqdm" in missing
    assert "sklearn" not in missing


def test_epoch_lines_are_written_through_the_progress_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0's line per epoch, printed by the rank, cut the bar in two; now the bar's thread prints it with
    tqdm.write (bar cleared, line on stdout, bar redrawn), including the last epoch's, read after the stop."""
    tqdm = pytest.importorskip("tqdm")
    written: list[str] = []
    real_write = tqdm.tqdm.write

    def spy(text: str, *args: Any, **kwargs: Any) -> None:
        written.append(text)
        real_write(text, *args, **kwargs)

    monkeypatch.setattr(tqdm.tqdm, "write", spy)
    records = [
        {"kind": "start", "epochs": 2, "steps_per_epoch": 1},
        {"kind": "step", "epoch": 1, "step": 1, "loss": 2.0},
        {"kind": "eval", "epoch": 1, "epochs": 2, "train_loss": 2.0, "test_accuracy": 0.5, "test_loss": 1.5},
        {"kind": "step", "epoch": 2, "step": 2, "loss": 1.0},
        {"kind": "eval", "epoch": 2, "epochs": 2, "train_loss": 1.0, "test_accuracy": 0.75, "test_loss": 0.5},
    ]
    path = tmp_path / "rank0.metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stop = threading.Event()
    stop.set()  # the job is over before the follower first looks: it must still read the file once
    paratrain.train.run.follow_progress(path, stop, [0], "allreduce (rank 0)")
    expected = [
        "epoch 1/2: train loss 2.0000, test accuracy 0.5000, test loss 1.5000",
        "epoch 2/2: train loss 1.0000, test accuracy 0.7500, test loss 0.5000",
    ]
    assert written == expected
    assert capsys.readouterr().out.splitlines() == expected


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--strategy", "bsp", "--min-workers", "1"], "--min-workers needs the allreduce strategy"),
        (["--workers", "2", "--min-workers", "3"], "--min-workers needs the allreduce strategy and 1..2"),
        (["--strategy", "gossip:ring", "--checkpoint-dir", "ckpt"], "--checkpoint-dir checkpoints allreduce"),
        (["--strategy", "tp:2", "--max-restarts", "1"], "restarts the dead workers of allreduce or bsp"),
    ],
)
def test_elastic_and_disk_checkpoint_flags_are_checked_before_any_worker_starts(
    flags: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(paratrain.launch.run, "run_launch", _no_launch)
    monkeypatch.setattr(paratrain.train.run, "run_launch", _no_launch, raising=False)
    assert main(["train", "--epochs", "1", *flags]) == 2
    assert says in capsys.readouterr().err
