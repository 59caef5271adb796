"""``paratrain topology``: matrix, spectral gap, traffic and JSON for named and user graphs; clear errors, exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.cli.main import main

pytestmark = pytest.mark.timeout(60)


def test_ring_end_to_end_with_json(tmp_path: Path) -> None:
    out = tmp_path / "ring.json"
    proc = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "topology", "ring", "--workers", "6", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "spectral gap: 0.333333" in proc.stdout
    assert "0.333  0.333  0.000" in proc.stdout  # row 1 of W, rounded
    assert "2.00 MiB" in proc.stdout  # 2 neighbours x 1 MiB
    report = json.loads(out.read_text())
    assert report["workers"] == 6
    assert report["spectral_gap"] == pytest.approx(1 - (1 / 3 + 2 / 3 * math.cos(2 * math.pi / 6)), abs=1e-12)
    w = report["mixing_matrix"]
    assert len(w) == 6 and all(len(row) == 6 for row in w)
    assert w[0][0] == pytest.approx(1 / 3) and w[0][1] == pytest.approx(1 / 3) and w[0][2] == 0.0
    assert report["traffic_per_step"][0] == {
        "rank": 0,
        "neighbors": 2,
        "bytes_sent": 2 << 20,
        "bytes_received": 2 << 20,
    }


@pytest.mark.parametrize(("graph", "workers", "gap"), [("complete", 5, 1.0), ("torus", 4, 2 / 3)])
def test_named_topologies_json_stdout(graph: str, workers: int, gap: float, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topology", graph, "-n", str(workers), "--bytes", "4KiB", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["spectral_gap"] == pytest.approx(gap, abs=1e-12)
    assert report["model_bytes"] == 4096


def test_graph_file_and_large_n(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "star.txt"
    path.write_text("0 1\n0 2\n0 3\n")
    assert main(["topology", str(path)]) == 0  # workers inferred: 4
    out = capsys.readouterr().out
    assert "4 workers, 3 edges" in out
    assert "0.250  0.750  0.000  0.000" in out
    assert main(["topology", "exponential", "-n", "32"]) == 0
    assert "not printed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["topology", "star", "-n", "4"], "neither one of ring"),
        (["topology", "ring"], "--workers N is needed"),
        (["topology", "ring", "-n", "0"], ">= 1"),
        (["topology", "ring", "-n", "4", "--bytes", "lots"], "bad --bytes"),
        (["topology", "ring", "-n", "4", "--decimals", "-1"], "--decimals"),
    ],
)
def test_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("paratrain topology: error:") and message in err


def test_file_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "split.txt"
    path.write_text("0 1\n2 3\n")
    assert main(["topology", str(path)]) == 2
    assert "not connected" in capsys.readouterr().err
    path.write_text("0 1\n1 oops\n")
    assert main(["topology", str(path), "-n", "2"]) == 2
    assert "line 2" in capsys.readouterr().err


def test_a_given_mixing_matrix_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json output, edited to a lazier ring, goes back in as a user-given W; bad matrices are refused."""
    path = tmp_path / "w.json"
    assert main(["topology", "ring", "-n", "4", "--json", str(path)]) == 0
    capsys.readouterr()
    report = json.loads(path.read_text())
    report["mixing_matrix"] = [[0.5 if i == j else 0.25 if (i - j) % 4 in (1, 3) else 0.0 for j in range(4)]
                               for i in range(4)]  # fmt: skip
    path.write_text(json.dumps(report))
    assert main(["topology", str(path), "--json", "-"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["workers"] == 4 and given["weights"] == f"given in {path}"
    assert given["edges"] == [[0, 1], [0, 3], [1, 2], [2, 3]]
    assert given["spectral_gap"] == pytest.approx(0.5, abs=1e-12)  # 1 - (1/2 + 1/2 cos(pi/2))
    for matrix, message in [
        ([[0.5, 0.6], [0.5, 0.4]], "not symmetric"),
        ([[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5]], "not connected"),
        ([[1, "a"]], "not a matrix of numbers"),
    ]:
        path.write_text(json.dumps({"mixing_matrix": matrix}))
        assert main(["topology", str(path)]) == 2
        assert message in capsys.readouterr().err
    path.write_text(json.dumps({"mixing_matrix": report["mixing_matrix"]}))
    assert main(["topology", str(path), "-n", "5"]) == 2
    assert "4 x 4 but the job has 5 workers" in capsys.readouterr().err
    path.write_text('{"w": 1}')
    assert main(["topology", str(path)]) == 2
    assert "must hold 'mixing_matrix'" in capsys.readouterr().err
