"""A training job is one description: the command line derives from it, and what a rank reads back is what the
command line said (CLI -> TrainJob -> job.json -> the worker's job)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from paratrain.cli import compare, train
from paratrain.cli.subcommand import parse_subcommand
from paratrain.errors import ConfigError
from paratrain.train.job import TrainJob, add_job_options, read_job, write_job

FLAGS = [
    "--model", "lenet", "--dataset", "fashion-mnist", "--data-dir", "/data", "--strategy", "sfb", "--epochs", "3",
    "--batch-size", "32", "--steps-per-epoch", "7", "--lr", "0.1", "--seed", "5", "--eval-every", "2",
    "--no-overlap", "--bucket-bytes", "1MiB", "--compression", "fp16", "--layer-scheme", "1=sfb",
    "--layer-scheme", "out=dense", "--workers", "3", "--straggler", "1:2", "--latency", "2ms", "--bandwidth",
    "100Mbit", "--microbatches", "2", "--balance", "3,3", "--checkpoint", "--kill", "1@step=4", "--run-dir",
    "runs/x", "--json", "s.json", "--max-restarts", "2", "--checkpoint-every", "4", "--no-spare",
]  # fmt: skip


def test_every_flag_reaches_the_job_a_rank_reads(tmp_path: Path) -> None:
    job = TrainJob.from_args(parse_subcommand(train, ["train", *FLAGS]))
    assert job.layer_scheme == ("1=sfb", "out=dense") and job.bucket_bytes == 1 << 20 and job.no_overlap
    assert job.checkpoint and job.no_spare and job.max_restarts == 2 and job.kill == "1@step=4"
    assert read_job(write_job(job, tmp_path)) == job


def test_no_flags_give_the_defaults() -> None:
    assert TrainJob.from_args(parse_subcommand(train, ["train"])) == TrainJob()


def test_each_field_is_one_flag_of_train_and_compare_takes_its_own_strategies() -> None:
    parser = argparse.ArgumentParser()
    add_job_options(parser, "train")
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(TrainJob)}
    args = parse_subcommand(compare, ["compare", "--strategies", "allreduce,bsp", "--epochs", "2", "--json", "c.json"])
    job = TrainJob.from_args(args)
    assert job.epochs == 2 and job.strategy == "allreduce" and job.json == "c.json"  # (compare replaces json)


def test_a_job_file_with_an_unknown_option_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text('{"model": "mlp", "epoch": 3}')
    with pytest.raises(ConfigError, match="no training option is called epoch"):
        read_job(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_job(tmp_path / "none.json")
