#!/usr/bin/env bash
# Reproduces the tables of benchmarks/allreduce/README.md: allreduce of paratrain against Gloo and OpenMPI,
# 2 and 4 ranks on this host, every engine measured in the same run on the same sizes.
#
# Needs the venv (`make setup`); for the MPI column also OpenMPI and mpi4py (the project does not require them):
#   apt-get install -y openmpi-bin libopenmpi-dev && .venv/bin/pip install mpi4py
# Run it on an otherwise idle machine: every engine spins or polls, and other load shows up in the numbers.
# Each engine runs 5 times, interleaved with the others, and the median run is reported (--repeat), so that one
# slow period on a shared machine does not decide a comparison. JSON results go to $OUT (default: a new temp dir).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-allreduce-XXXXXX)}
SIZES=4KiB,1MiB,16MiB,64MiB

for NP in 2 4; do
    .venv/bin/paratrain bench allreduce --np "$NP" --sizes "$SIZES" --compare gloo,mpi --repeat 5 \
        --json "$OUT/np$NP.json"
done
# The public API with the shared-memory algorithm registered (pays the API's per-call agreement over ZeroMQ).
.venv/bin/paratrain bench allreduce --np 2 --sizes "$SIZES" --algorithm shm --compare none --repeat 3 \
    --json "$OUT/np2-api-shm.json"
echo "results in $OUT"
