#!/usr/bin/env bash
# The GPU checks of issues 19 and 42, for one short visit to a machine with a CUDA device (CI has none; the CUDA
# tests skip there). Needs what the package installs (torch, numpy, pyzmq, msgpack; matplotlib and tqdm for
# `paratrain train`) and the four Fashion-MNIST IDX files (DATA_DIR; default Debian's dataset-fashion-mnist).
#
# Every step runs under its own time limit, cut to what is left of BUDGET seconds (default 450: the whole script
# ends within 8 minutes), and runs even if one before it failed; the exit status says whether all passed.
# Results: at most 8 files in $OUT (default: a new temp dir):
#   device.txt     the device(s), torch, the commit, and each step's exit status and seconds
#   run.log        everything the steps printed (the CUDA tests' -rA list of every test's outcome among it)
#   rounding.json  item 2: the pipeline against one process, GPU against CPU, float32 and float64 (rounding.py)
#   overlap.json   item 3: how much of the staged device-to-host copies ran while backward computed (overlap.py)
#   speed.json     item 4: paratrain against DDP, two ranks sharing the GPU and one rank alone (speed.py)
#   lenet.json     LeNet-5 on Fashion-MNIST with allreduce and bsp, CPU against GPU accuracy (lenet.py)
#   traces.tar.gz  the profiler traces behind overlap.json and speed.json (chrome://tracing, Perfetto)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-gpu-XXXXXX)}
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
BUDGET=${BUDGET:-450}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
WORK=$(mktemp -d /tmp/paratrain-gpu-work-XXXXXX)
mkdir -p "$OUT" "$WORK/traces"
begin=$(date +%s)
status=0
info="$OUT/device.txt"
log="$OUT/run.log"
: >"$info"
: >"$log"

step() { # step NAME LIMIT CMD...: CMD under min(LIMIT, budget left) seconds, output to run.log; notes exit and time
    local name=$1 limit=$2 left start rc
    shift 2
    left=$((BUDGET - ($(date +%s) - begin)))
    if ((left < limit)); then limit=$left; fi
    if ((limit < 10)); then
        echo "$name: skipped, the budget of ${BUDGET}s is spent" | tee -a "$info"
        status=1
        return
    fi
    echo "=== $name (limit ${limit}s)" >>"$log"
    start=$(date +%s.%N)
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $start}")s (limit ${limit}s)" | tee -a "$info"
    if ((rc != 0)); then status=1; fi
}

{
    date -u +%FT%TZ
    echo "commit $COMMIT"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'devices', torch.cuda.device_count(), 'nccl', d.is_nccl_available(),
'tf32 matmul', torch.backends.cuda.matmul.allow_tf32, 'tf32 cudnn', torch.backends.cudnn.allow_tf32)"
} 2>&1 | tee -a "$info"

export PYTHONUNBUFFERED=1
step cuda-tests 200 "$PY" -m pytest -q -rA -p no:cacheprovider -m cuda tests/cuda
step rounding 90 "$PY" benchmarks/gpu/rounding.py "$WORK"
cp "$WORK/rounding.json" "$OUT/" 2>/dev/null
step overlap 90 "$PY" benchmarks/gpu/overlap.py "$WORK"
cp "$WORK/overlap.json" "$OUT/" 2>/dev/null
mv "$WORK/overlap-trace.json" "$WORK/traces/" 2>/dev/null
step speed 240 "$PY" benchmarks/gpu/speed.py "$WORK" --profile
cp "$WORK/speed.json" "$OUT/" 2>/dev/null
step lenet 200 "$PY" benchmarks/gpu/lenet.py "$WORK/lenet" --data-dir "$DATA_DIR" --epochs 2 --steps-per-epoch 100
cp "$WORK/lenet/lenet.json" "$OUT/" 2>/dev/null
tar -czf "$OUT/traces.tar.gz" -C "$WORK" traces 2>/dev/null
echo "total: $(($(date +%s) - begin))s, exit $status" | tee -a "$info"
echo "results in $OUT"
exit $status
