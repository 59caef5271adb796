"""``paratrain bench ps`` end to end on a tiny key: table, JSON keys, flag errors, nothing left running.

Never asserts timings: other work shares the machine, and a benchmark's numbers belong in its README.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.bench.ps import combine_runs, parse_consistency, summarize

pytestmark = pytest.mark.timeout(60)

TOP_KEYS = {
    "benchmark",
    "workers",
    "servers",
    "consistency",
    "dtype",
    "sizes",
    "iters",
    "warmup",
    "repeat",
    "chunk_bytes",
    "hosts",
    "transport",
    "date",
    "machine",
    "definitions",
    "engines",
    "memcpy",
    "results",
}
ROW_KEYS = {
    "engine",
    "bytes",
    "size",
    "chunks",
    "servers_used",
    "iters",
    "mean_ms",
    "p50_ms",
    "p90_ms",
    "runs_ms",
    "worker_gbps",
    "aggregate_gbps",
    "phases_ms",
}


def _bench(*args: str, timeout: float = 50, marker: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PARATRAIN_BENCH_TEST_MARK=marker or "none")
    return subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "bench", "ps", *args],
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
    out = tmp_path / "ps.json"
    marker = secrets.token_hex(6)
    result = _bench(
        "--workers", "2", "--servers", "1", "--size", "64KiB", "--iters", "3", "--repeat", "1", "--warmup", "1",
        "--json", str(out), marker=marker,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[1/2] ps:" in result.stdout and "[2/2] ceiling:" in result.stdout  # progress while it runs
    for column in ("p50 ms", "p90 ms", "worker GB/s", "total GB/s", "% ceiling", "% memcpy"):
        assert column in result.stdout
    assert "memcpy" in result.stdout and "push" in result.stdout
    report = json.loads(out.read_text())
    assert report.keys() >= TOP_KEYS
    assert report["benchmark"] == "ps" and report["sizes"] == [65536] and report["iters"] == [3]
    assert (report["workers"], report["servers"], report["consistency"]) == (2, 1, "bsp")
    assert report["engines"] == {"ps": {"status": "ok", "detail": ""}, "ceiling": {"status": "ok", "detail": ""}}
    assert [m["bytes"] for m in report["memcpy"]] == [65536] and report["memcpy"][0]["gbps"] > 0
    rows = {row["engine"]: row for row in report["results"]}
    assert set(rows) == {"ps", "ceiling"}
    for row in rows.values():
        assert row.keys() >= ROW_KEYS
        assert row["bytes"] == 65536 and row["iters"] == 3 and row["chunks"] == 1 and row["mean_ms"] > 0
        assert row["aggregate_gbps"] == pytest.approx(2 * row["worker_gbps"], abs=2e-4)  # both rounded to 4 places
    assert set(rows["ps"]["phases_ms"]) == {"push", "clock", "pull"}
    assert rows["ps"]["pct_of_ceiling"] > 0 and rows["ps"]["pct_of_memcpy"] > 0
    assert _processes_with(marker) == []


def _emulated_hosts() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith("ptb")}


def test_two_emulated_hosts_put_workers_and_servers_apart(tmp_path: Path) -> None:
    from paratrain.bench import netns

    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    before = _emulated_hosts()
    out = tmp_path / "ps.json"
    result = _bench(
        "--workers", "1", "--servers", "1", "--size", "256KiB", "--iters", "2", "--warmup", "0", "--hosts", "2",
        "--json", str(out),
    )  # fmt: skip
    if result.returncode == 2 and "cannot emulate two hosts" in result.stderr:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "two emulated hosts" in result.stdout
    report = json.loads(out.read_text())
    assert report["hosts"] == 2 and "TCP" in report["transport"]
    assert report["engines"] == {"ps": {"status": "ok", "detail": ""}, "ceiling": {"status": "ok", "detail": ""}}
    assert _emulated_hosts() <= before  # the namespaces went with the bench


def test_two_servers_and_ssp_split_the_key(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    result = _bench(
        "--workers", "2", "--servers", "2", "--size", "2MiB", "--iters", "2", "--warmup", "0",
        "--consistency", "ssp:1", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["consistency"] == "ssp:1"
    assert {row["engine"]: row["chunks"] for row in report["results"]} == {"ps": 2, "ceiling": 2}
    assert {row["servers_used"] for row in report["results"]} == {2}


def test_a_job_past_its_deadline_is_reported_and_stopped(tmp_path: Path) -> None:
    # 2 s is far too little for 10000 iterations of 16 MiB: the workers give up (exit 124), the launcher stops the
    # job, both engines are reported as failed, and nothing is left running.
    marker = secrets.token_hex(6)
    out = tmp_path / "ps.json"
    result = _bench(
        "--workers", "2", "--servers", "1", "--size", "16MiB", "--iters", "10000", "--timeout", "2",
        "--json", str(out), marker=marker,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert {info["status"] for info in report["engines"].values()} == {"error"}
    assert report["results"] == []
    assert "ps: error" in result.stdout and "Traceback" not in result.stdout
    assert _processes_with(marker) == []


def test_the_last_guard_kills_what_the_bench_started() -> None:
    # A job that ignores every polite signal and outlives the deadline: the launch library's deadline kills its
    # process group (the bench no longer walks /proc itself). Run in a fresh interpreter, so that the supervisor
    # owns the main thread and its signal handlers, as in `paratrain bench ps`. The deadline leaves the child 2 s
    # to start and ignore SIGTERM: with 0.3 s a loaded machine killed it before it got there (a flaky test).
    script = (
        "import os\n"
        "from paratrain.launch.run import run_commands\n"
        "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)'\n"
        "outcome = run_commands([(['python3', '-c', code], dict(os.environ))], deadline_s=2.0, grace_s=0.3)\n"
        "print(outcome.timed_out, outcome.exit_code)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "124"]
    assert "did not stop within 0.3 s of SIGTERM; sending SIGKILL" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--servers", "0"], "--servers must be at least 1"),
        (["--size", "3"], "multiple of 4"),
        (["--size", "4 parsecs"], "bad size"),
        (["--iters", "0"], "--iters must be at least 1"),
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--consistency", "ssp"], "ssp:S"),
        (["--consistency", "eventual"], "bad consistency"),
        (["--timeout", "-1"], "--timeout must be positive"),
        (["--hosts", "3"], "invalid choice"),
        (["--hosts", "2", "--servers", "2", "--replicas", "2"], "runs without replicas"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    result = _bench(*args, timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "paratrain.cli.main", "bench", "ps", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0 and "usage:" in result.stdout
    for word in ("--consistency", "--json", "ceiling", "% ceiling", "worker GB/s"):
        assert word in result.stdout


# -- the pure parts -------------------------------------------------------------------------------------------------


def test_parse_consistency() -> None:
    assert parse_consistency("BSP") == ("bsp", None)
    assert parse_consistency("ssp:0") == ("ssp", 0)
    assert parse_consistency("asp") == ("asp", None)
    for bad in ("ssp", "ssp:-1", "ssp:x", "bsp:1", "asp:2", ""):
        with pytest.raises(ValueError, match="consistency"):
            parse_consistency(bad)


def test_summary_is_the_slowest_worker_and_counts_push_plus_pull() -> None:
    def record(total: float, times: list[float]) -> dict[str, object]:
        phases = {"push": total / 4, "clock": total / 4, "pull": total / 2}
        result = {"bytes": 1 << 20, "chunks": 1, "iters": len(times), "total_s": total, "times_s": times}
        return {"results": [{**result, "phases_s": phases}]}

    times_a = [0.001] * 9 + [0.010]
    times_b = [0.002] * 10
    (row,) = summarize("ps", [record(0.019, times_a), record(0.020, times_b)], 2)
    assert row["mean_ms"] == 2.0  # the slowest worker's loop time / iterations
    assert row["p50_ms"] == 2.0 and row["p90_ms"] == 10.0  # over the per-iteration maximum
    assert row["worker_gbps"] == round(2 * (1 << 20) / 0.002 / 1e9, 4)
    assert row["aggregate_gbps"] == round(2 * row["worker_gbps"], 4)
    assert row["phases_ms"]["pull"] == pytest.approx((0.019 + 0.020) / 2 / 2 / 10 * 1e3, abs=1e-4)
    merged = combine_runs([[row], [{**row, "mean_ms": 4.0}], [{**row, "mean_ms": 1.0}]])[0]
    assert merged["mean_ms"] == 2.0 and merged["runs_ms"] == [2.0, 4.0, 1.0]
