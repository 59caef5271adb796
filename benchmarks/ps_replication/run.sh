#!/usr/bin/env bash
# Reproduces the cost table of benchmarks/ps_replication/README.md: push+clock+pull with --replicas 2 against
# --replicas 1, same job otherwise (2 workers, 2 servers, BSP). The two configurations alternate, one run each,
# ROUNDS times (default 3), so that a slow period of a shared machine hits both alike; compare.py then prints,
# per size, the ratio of each pair and their median and spread. JSON results go to $OUT (default: a new temp dir).
#
# Run it on an otherwise idle machine (each job has more processes than a small machine has cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-psrep-XXXXXX)}
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-64KiB,1MiB,16MiB}
WORKERS=${WORKERS:-2}
SERVERS=${SERVERS:-2}
PARATRAIN=${PARATRAIN:-.venv/bin/paratrain}

for i in $(seq 1 "$ROUNDS"); do
    for r in 1 2; do
        "$PARATRAIN" bench ps --workers "$WORKERS" --servers "$SERVERS" --replicas "$r" --size "$SIZES" \
            --repeat 1 --json "$OUT/replicas$r-run$i.json"
    done
done
.venv/bin/python benchmarks/ps_replication/compare.py "$OUT"
echo "results in $OUT"
