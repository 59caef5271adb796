"""Tensor parallelism with real processes: the README's example, 2-way tensor x 2-way data parallel under
``paratrain launch``, ends at the parameters of the whole model trained in one process (float32 rounding), with
every worker holding part of the split layers."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.timeout(180)


def test_the_example_on_a_2x2_grid_ends_at_the_one_process_model() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "4", "--", sys.executable, "-m",
         "paratrain.examples.tensor_parallel", "--tensor", "2", "--steps", "20"],
        capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    log = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, log
    line = r"rank (\d): loss on its rows [\d.]+, holds ([\d,]+) of the model's ([\d,]+) parameters"
    held = {int(r): (int(h.replace(",", "")), int(t.replace(",", ""))) for r, h, t in re.findall(line, out.stdout)}
    assert set(held) == {0, 1, 2, 3}, log
    # 64x512 + 512 and 512x512 halved; the row-split layer's bias on the first of each tensor group only
    total = held[0][1]
    assert held[0][0] == total - (64 * 512 + 512) // 2 - 512 * 512 // 2, log
    assert held[1][0] == held[0][0] - 512 and held[2] == held[0] and held[3] == held[1], log
    diff = float(re.search(r"trained in one process: ([\d.e+-]+)", out.stdout).group(1))  # type: ignore[union-attr]
    assert diff < 1e-5, log
