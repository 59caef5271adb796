"""Summarises runs.jsonl (benchmarks/ps_resize/run.sh) into medians and spreads per configuration."""

from __future__ import annotations

import json
import statistics
import sys
from datetime import date


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as lines:
        runs = [json.loads(line) for line in lines if line.strip()]
    configs = sorted({(r["servers"], r["active"]) for r in runs})
    out = {"command": "benchmarks/ps_resize/run.sh", "date": str(date.today()), "configurations": []}
    for servers, active in configs:
        rows = [r for r in runs if (r["servers"], r["active"]) == (servers, active)]
        adds = [x for r in rows for x in r["resizes"] if x["what"] == "add"]
        removes = [x for r in rows for x in r["resizes"] if x["what"] == "remove"]
        total_bytes, total_chunks = rows[0]["bytes"], rows[0]["chunks"]
        pauses = [max(r["pauses_s"]) for r in rows]

        def spread(values: list[float]) -> dict[str, float]:
            return {"median": statistics.median(values), "min": min(values), "max": max(values)}

        out["configurations"].append(
            {
                "servers_started": servers,
                "active_at_start": active,
                "runs": len({r["run"] for r in rows}),
                "key_bytes": total_bytes,
                "chunks": total_chunks,
                "add_moved_chunks_fraction": spread([a["chunks"] / total_chunks for a in adds]),
                "add_moved_bytes_fraction": spread([a["bytes"] / total_bytes for a in adds]),
                "target_fraction": round(1.2 / (active + 1), 4),
                "remove_moved_bytes_fraction": spread([x["bytes"] / total_bytes for x in removes]),
                "add_seconds": spread([a["seconds"] for a in adds]),
                "remove_seconds": spread([x["seconds"] for x in removes]),
                "worker_pause_s_max_per_run": spread(pauses),
                "job_seconds": spread([r["seconds"] for r in rows]),
            }
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
