#!/usr/bin/env bash
# Reproduces the tables of benchmarks/ps/README.md: the parameter server's push+clock+pull against the ceiling of
# its transport (the same chunks echoed by the same number of processes over the same transport, with no PS
# logic) and against one core's memcpy, all measured in the same command: on this host (ipc headers, data in
# shared-memory lanes, values read in place), and across two emulated hosts (network namespaces joined by a veth
# pair, TCP between them; needs root).
#
# Needs only the venv (`make setup`). Run it on an otherwise idle machine: the jobs use more processes than a
# small machine has cores, and other load shows up in the numbers (each command prints how busy the CPUs were
# just before it). Each job runs 5 times (3 for the extra rows), interleaved with the ceiling's, and the median run
# is reported (--repeat), so that one slow period on a shared machine does not decide a ratio.
# JSON results go to $OUT (default: a new temp dir).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-ps-XXXXXX)}
SIZES=64KiB,16MiB

.venv/bin/paratrain bench ps --workers 1 --servers 1 --size "$SIZES" --repeat 5 --json "$OUT/w1s1.json"
.venv/bin/paratrain bench ps --workers 2 --servers 1 --size "$SIZES" --repeat 5 --json "$OUT/w2s1.json"
.venv/bin/paratrain bench ps --workers 2 --servers 2 --size "$SIZES" --repeat 5 --json "$OUT/w2s2.json"
.venv/bin/paratrain bench ps --workers 3 --servers 1 --size "$SIZES" --repeat 3 --json "$OUT/w3s1.json"
# The consistency model's share: ASP never waits for the other worker, SSP with s=1 waits one clock less often.
.venv/bin/paratrain bench ps --workers 2 --servers 1 --size "$SIZES" --consistency asp --repeat 3 --json "$OUT/w2s1-asp.json"
.venv/bin/paratrain bench ps --workers 2 --servers 1 --size "$SIZES" --consistency ssp:1 --repeat 3 --json "$OUT/w2s1-ssp1.json"
# Across hosts: workers on one emulated host, servers (and the ceiling's echo ranks) on the other.
.venv/bin/paratrain bench ps --workers 2 --servers 1 --size "$SIZES" --hosts 2 --repeat 3 --json "$OUT/w2s1-hosts2.json"
.venv/bin/paratrain bench ps --workers 2 --servers 2 --size "$SIZES" --hosts 2 --repeat 3 --json "$OUT/w2s2-hosts2.json"
echo "results in $OUT"
