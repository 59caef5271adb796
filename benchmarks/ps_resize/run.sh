#!/usr/bin/env bash
# Servers joining and leaving a running job: what moves and how long the workers pause (paratrain.examples.ps_resize).
# Each configuration runs 5 times; each run is a fresh `paratrain launch` on this machine. Writes resize.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/ps_resize/runs.jsonl
: > "$out"
for run in 1 2 3 4 5; do
  for cfg in "4 2 2 0" "5 3 3 0"; do   # servers started, active at the start, server added, server removed
    read -r servers active add remove <<< "$cfg"
    paratrain launch -n 2 --servers "$servers" -- python -m paratrain.examples.ps_resize --mib 16 --clocks 20 \
      --active "$active" --add "$add" --remove "$remove" --add-at 6 --remove-at 12 \
      | sed -n 's/^\[rank[0-9]\]: \({"rank".*\)$/\1/p' \
      | python -c "import json,sys; [print(json.dumps({'run': $run, 'servers': $servers, 'active': $active, **json.loads(l)})) for l in sys.stdin]" >> "$out"
  done
done
python benchmarks/ps_resize/summarise.py "$out" > benchmarks/ps_resize/resize.json
