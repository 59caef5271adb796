"""reduce, gather, scatter and all-to-all as real processes on one host (``paratrain launch -n 3``): the
agreement, the counts and (but for reduce's tree) the data go through the shared-memory segment, arrays of several
1 MiB blocks and of uneven sizes too; every rank's result equals the reference."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)

JOB = """
import json
import numpy as np
import paratrain as pt

ctx = pt.init()
r, n = pt.rank(), pt.world_size()
reduced = pt.reduce(np.arange(4) * (r + 1), root=1)
gathered = pt.gather(np.full(r + 1, r), root=0)
out = {
    "shm": ctx.collectives._shm is not None,
    "reduce": None if reduced is None else reduced.tolist(),
    "gather": None if gathered is None else gathered.tolist(),
    "scatter": pt.scatter(np.arange(7), root=2).tolist(),
    "alltoall": pt.alltoall(np.arange(2 * n) + 100 * r).tolist(),
}
big = np.arange((r + 1) * 200_003, dtype=np.float64) + r  # 1.6-4.8 MB: several blocks, uneven
gathered = pt.gather(big, root=2)
parts = pt.scatter(np.arange(600_001.0) if r == 0 else np.zeros(0), root=0, counts=[1, 450_000, 150_000])
swapped = pt.alltoall(np.arange(3 * 100_000.0).reshape(-1, 3) * (r + 1), counts=[50_000, 0, 50_000])
out["big"] = [None if gathered is None else float(gathered.sum()), float(parts.sum()), len(parts),
              float(swapped.sum()), swapped.shape[0]]
print("RESULT", json.dumps([r, out]), flush=True)
pt.shutdown()
"""


def test_the_four_operations_as_processes(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "paratrain.cli.main",
            "launch",
            "-n",
            "3",
            "--no-prefix",
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = dict(json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert sorted(results) == [0, 1, 2]
    assert all(results[r]["shm"] for r in results)  # the agreement went through shared memory
    assert [results[r]["reduce"] for r in range(3)] == [None, [0, 6, 12, 18], None]
    assert [results[r]["gather"] for r in range(3)] == [[0, 1, 1, 2, 2, 2], None, None]
    assert [results[r]["scatter"] for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    big = [np.arange((q + 1) * 200_003, dtype=np.float64) + q for q in range(3)]
    whole = np.arange(600_001.0)
    parts = [whole[:1], whole[1:450_001], whole[450_001:]]
    rows = np.arange(3 * 100_000.0).reshape(-1, 3)
    sent = [rows[:50_000], rows[50_000:50_000], rows[50_000:]]  # each rank's part q, times (its rank + 1)
    for r in range(3):
        g, p_sum, p_len, a_sum, a_rows = results[r]["big"]
        assert g == (float(sum(b.sum() for b in big)) if r == 2 else None)
        assert (p_sum, p_len) == (float(parts[r].sum()), len(parts[r]))
        assert (a_sum, a_rows) == (float(sum(sent[r].sum() * (q + 1) for q in range(3))), 3 * len(sent[r]))
    assert [results[r]["alltoall"] for r in range(3)] == [
        [q * 100 + v for q in range(3) for v in (2 * r, 2 * r + 1)] for r in range(3)
    ]
