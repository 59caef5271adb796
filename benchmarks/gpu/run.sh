#!/usr/bin/env bash
# The GPU checks of issue 19, for a machine with a CUDA device (CI has none; the CUDA tests skip there).
# Prints the device, then runs every test marked `cuda` (tests/cuda/: collectives and the DistributedOptimizer
# with CUDA tensors, two thread ranks sharing the GPU, compared with the CPU run), then overlap.py (how much of
# the gradients' device-to-host copies ran while kernels computed, from torch's profiler). Results go to $OUT
# (default: a new temp dir): a JUnit XML file, the logs, overlap.json and the profiler's trace.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-gpu-XXXXXX)}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; } | tee "$OUT/device.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())" \
    | tee -a "$OUT/device.txt"
"$PY" -m pytest -q -m cuda tests/cuda --junitxml="$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.log"
"$PY" benchmarks/gpu/overlap.py "$OUT" 2>&1 | tee "$OUT/overlap.log"   # do the staged copies overlap backward?
echo "results in $OUT"
