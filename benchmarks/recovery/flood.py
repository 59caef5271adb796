"""A job under a flood of strangers: its result and its time, against the same job left alone.

A launched job of two ranks (``paratrain launch -n 2``, each its own host id, so that they talk over TCP) passes
1 MiB arrays back and forth and prints a checksum of everything it received. With ``--strangers N``, N concurrent
connections without the secret hammer rank 1's TCP and ipc endpoints for the whole run, each in turn declaring a
1 GiB handshake frame, stalling after its greeting, and writing random bytes. Rounds alternate the flooded and the
quiet run; prints JSON (every run's checksum, seconds and each rank's peak resident memory) to stdout.

    python benchmarks/recovery/flood.py --strangers 500 --rounds 3 > flood.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from paratrain.transport.probe import connect_raw, declared_frame, greeting

JOB = """
import hashlib, json, os, sys, time
import numpy as np
import paratrain as pt

os.environ["PARATRAIN_HOST_ID"] = "host-" + os.environ["RANK"]  # two hosts: the ranks talk over TCP
ctx = pt.init(timeout=120)
t = ctx.transport
if ctx.rank == 1:
    Path = __import__("pathlib").Path
    Path(sys.argv[1] + ".tmp").write_text(json.dumps(t.endpoints()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
pt.barrier()
if ctx.rank == 0:  # wait for the flood to start (the driver touches this file)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
pt.barrier()
start = time.monotonic()
digest = hashlib.sha256()
rng = np.random.default_rng(ctx.rank)
for i in range(int(sys.argv[3])):
    x = rng.standard_normal(1 << 18).astype(np.float32)  # 1 MiB
    if ctx.rank == 0:
        t.send(1, i, [x]); got = t.recv(1, i).arrays[0]
    else:
        got = t.recv(0, i).arrays[0]; t.send(0, i, [x])
    digest.update(got.tobytes())
pt.barrier()
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
line = {"rank": ctx.rank, "seconds": time.monotonic() - start, "checksum": digest.hexdigest(), "peak_rss_mib": peak}
print(json.dumps(line), flush=True)
pt.shutdown()
"""


def _stranger(endpoints: list[tuple[str, bytes]], stop: threading.Event, seed: int, counts: list[int]) -> None:
    """One stranger: connection after connection, each an oversized frame, a stalled greeting or random bytes."""
    rng = random.Random(seed)
    chunk = bytes(1 << 16)
    while not stop.is_set():
        endpoint, mechanism = rng.choice(endpoints)
        try:
            sock = connect_raw(endpoint)
        except OSError:
            continue
        sock.settimeout(5.0)
        try:
            kind = rng.randrange(3)
            if kind == 0:
                sock.sendall(greeting(mechanism) + declared_frame(1 << 30))
                while not stop.is_set():
                    sock.sendall(chunk)
            elif kind == 1:
                sock.sendall(greeting(mechanism))
                stop.wait(rng.uniform(0.5, 6.0))
            else:
                sock.sendall(rng.randbytes(rng.randrange(1, 4096)))
        except OSError:
            pass
        finally:
            sock.close()
        counts[0] += 1


def run_job(strangers: int, steps: int, workdir: Path) -> dict[str, object]:
    """One launched job, flooded by ``strangers`` concurrent connections (0: left alone)."""
    endpoints_file, go_file, script = workdir / "endpoints.json", workdir / "go", workdir / "job.py"
    for f in (endpoints_file, go_file):
        f.unlink(missing_ok=True)
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if k not in ("PARATRAIN_SECRET", "PARATRAIN_INSECURE")}
    cmd = [sys.executable, "-m", "paratrain.cli.main", "launch", "-n", "2", "--no-prefix", "--"]
    job = subprocess.Popen(
        [*cmd, sys.executable, str(script), str(endpoints_file), str(go_file), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stop, counts, threads = threading.Event(), [0], []
    try:
        deadline = time.monotonic() + 120
        while not endpoints_file.exists():
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError(f"the job did not publish its endpoints: {job.communicate()}")
            time.sleep(0.01)
        ends = json.loads(endpoints_file.read_text())
        targets = [(ends["tcp"], b"CURVE")] + ([(ends["ipc"], b"PLAIN")] if ends.get("ipc") else [])
        for i in range(strangers):
            th = threading.Thread(target=_stranger, args=(targets, stop, i, counts), daemon=True)
            th.start()
            threads.append(th)
        go_file.touch()
        out, err = job.communicate(timeout=600)
    finally:
        stop.set()
        job.kill()
        for th in threads:
            th.join(10)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if job.returncode != 0 or len(lines) != 2:
        raise RuntimeError(f"the job failed ({job.returncode}): {out}\n{err[-3000:]}")
    return {
        "strangers": strangers,
        "connections": counts[0],
        "seconds": max(float(line["seconds"]) for line in lines),
        "checksums": sorted(str(line["checksum"]) for line in lines),
        "peak_rss_mib": {int(line["rank"]): line["peak_rss_mib"] for line in lines},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strangers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="1 MiB round trips per job (default 400)")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = (0, args.strangers) if r % 2 == 0 else (args.strangers, 0)
            for n in order:
                runs.append({"round": r, **run_job(n, args.steps, Path(tmp))})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
