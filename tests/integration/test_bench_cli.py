"""``paratrain bench allreduce`` end to end on tiny sizes: table, JSON, errors, deadlines. Never asserts timings."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.bench.allreduce import horovod_unavailable, mpi_unavailable, summarize
from paratrain.bench.harness import parse_size, parse_sizes

pytestmark = pytest.mark.timeout(120)

ROW_KEYS = {"engine", "bytes", "size", "iters", "time_us", "p50_us", "runs_us", "algbw_gbps", "busbw_gbps"}
TOP_KEYS = {
    "benchmark",
    "np",
    "dtype",
    "op",
    "algorithm",
    "sizes",
    "compare",
    "repeat",
    "date",
    "machine",
    "timing",
    "engines",
}


def _bench(*args: str, timeout: float = 90, marker: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PARATRAIN_BENCH_TEST_MARK=marker or "none")
    return subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "bench", "allreduce", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def _processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment carries ``marker`` (children the benchmark left behind)."""
    found = []
    needle = f"PARATRAIN_BENCH_TEST_MARK={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry))
    return found


def test_end_to_end_table_and_json(tmp_path: Path) -> None:
    anchors = []
    if importlib.util.find_spec("torch") is not None:
        anchors.append("gloo")
    if mpi_unavailable() is None:
        anchors.append("mpi")
    if horovod_unavailable() is None:  # built here with benchmarks/horovod/build.sh; CI has no Horovod
        anchors.append("horovod")
    out = tmp_path / "bench.json"
    marker = secrets.token_hex(6)
    result = _bench(
        "--np", "2", "--sizes", "4KiB", "--iters", "3", "--compare", ",".join(anchors) or "none", "--json", str(out),
        marker=marker,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "time (us)" in result.stdout and "busbw GB/s" in result.stdout
    assert "paratrain[auto]" in result.stdout and "paratrain-shm" in result.stdout
    assert "[1/" in result.stdout  # progress while it runs
    report = json.loads(out.read_text())
    assert report.keys() >= TOP_KEYS | {"results"}
    assert report["np"] == 2 and report["sizes"] == [4096]
    engines = {row["engine"] for row in report["results"]}
    assert engines == {"paratrain[auto]", "paratrain-shm", *anchors}
    for row in report["results"]:
        assert row.keys() >= ROW_KEYS
        assert row["bytes"] == 4096 and row["iters"] == 3 and row["time_us"] > 0
        if row["engine"].startswith("paratrain"):
            assert set(row["ratios"]) == set(anchors)
    assert all(info["status"] == "ok" for info in report["engines"].values()), report["engines"]
    assert _processes_with(marker) == []


def test_the_torch_distributed_engine_is_a_paratrain_row_with_the_gloo_anchor(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    result = _bench("--np", "2", "--sizes", "4KiB", "--iters", "3", "--algorithm", "gloo", "--no-shm",
                    "--compare", "gloo", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = {row["engine"]: row for row in report["results"]}
    assert set(rows) == {"paratrain[gloo]", "gloo"} and set(rows["paratrain[gloo]"]["ratios"]) == {"gloo"}


@pytest.mark.skipif(horovod_unavailable() is None, reason="Horovod is installed here: it runs above")
def test_a_missing_horovod_is_a_skipped_column_that_says_how_to_build_it(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = _bench("--np", "2", "--sizes", "4KiB", "--iters", "3", "--compare", "horovod", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    engines = json.loads(out.read_text())["engines"]
    assert engines["horovod"]["status"] == "skipped" and "build.sh" in engines["horovod"]["detail"]


@pytest.mark.parametrize("sizes", ["4XB", "3", "0", "-4KiB", "1.5MiB", ",", "8GiB"])
def test_bad_sizes_exit_2_with_a_clear_message(sizes: str) -> None:
    result = _bench("--np", "2", f"--sizes={sizes}", "--compare", "none", timeout=30)
    assert result.returncode == 2
    assert "--sizes" in result.stderr and ("size" in result.stderr.lower())
    assert "Traceback" not in result.stderr


def test_bad_options_exit_2() -> None:
    result = _bench("--np", "0", "--sizes", "4KiB", "--compare", "none", timeout=30)
    assert result.returncode == 2 and "--np must be at least 1" in result.stderr
    result = _bench("--compare", "nccl", timeout=30)
    assert result.returncode == 2 and "unknown anchor nccl" in result.stderr


def test_help_on_every_command() -> None:
    for args in (["bench", "--help"], ["bench", "allreduce", "--help"]):
        result = subprocess.run(
            [sys.executable, "-m", "paratrain.cli.main", *args], capture_output=True, text=True, timeout=30, check=False
        )
        assert result.returncode == 0 and "usage:" in result.stdout
    assert "busbw" in result.stdout and "--json" in result.stdout


def test_engine_past_its_deadline_is_reported_and_stopped(tmp_path: Path) -> None:
    # 1 s is far too little for 1000 calls of 64 MiB: the workers give up, the failure is reported, nothing lingers.
    marker = secrets.token_hex(6)
    out = tmp_path / "bench.json"
    result = _bench(
        "--np", "2", "--sizes", "64MiB", "--iters", "1000", "--compare", "none", "--timeout", "1", "--json", str(out),
        marker=marker,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error" in result.stdout
    report = json.loads(out.read_text())
    assert report["engines"]["paratrain[auto]"]["status"] == "error"
    assert _processes_with(marker) == []


# -- the pure parts -------------------------------------------------------------------------------------------------


def test_parse_size_units() -> None:
    assert [parse_size(s) for s in ("1024", "4KiB", "4k", "1MiB", "16MB", "2G", "8 B")] == [
        1024,
        4096,
        4096,
        1 << 20,
        16_000_000,
        2 << 30,
        8,
    ]
    assert parse_sizes("4KiB,1MiB,4096") == [4096, 1 << 20]
    for bad in ("", "KiB", "4 parsecs", "6", "5GiB"):
        with pytest.raises(ValueError, match="size"):
            parse_sizes(bad)


def test_summary_uses_the_slowest_rank_and_nccl_bus_bandwidth() -> None:
    def record(total: float, times: list[float]) -> dict[str, object]:
        return {"results": [{"bytes": 1 << 20, "iters": len(times), "total_s": total, "times_s": times}]}

    rows = summarize("x", [record(0.003, [0.001, 0.001, 0.001]), record(0.006, [0.001, 0.004, 0.001])], 4)
    (row,) = rows
    assert row["time_us"] == 2000.0  # the slowest rank's mean
    assert row["p50_us"] == 1000.0  # median over calls of the per-call maximum: [1, 4, 1] ms
    assert row["algbw_gbps"] == round((1 << 20) / 0.002 / 1e9, 4)
    assert row["busbw_gbps"] == round(row["algbw_gbps"] * 2 * 3 / 4, 4)
