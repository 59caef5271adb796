#!/usr/bin/env bash
# The GPU checks of issue 19, for a machine with a CUDA device (CI has none; the CUDA tests skip there).
#  1. prints the device(s) and the commit;
#  2. every test marked `cuda` (tests/cuda/: collectives, the DistributedOptimizer under allreduce, bsp, gossip and
#     sfb, pipelines, the Horovod engine, the torch.distributed engines: NCCL at world size 1 with one GPU, Gloo
#     with CUDA tensors; each compared with the CPU run);
#  3. overlap.py: how much of the gradients' device-to-host copies ran while backward's kernels computed;
#  4. lenet.py: two workers train LeNet-5 on Fashion-MNIST with allreduce and with bsp, on the CPU and on the GPU
#     (DATA_DIR: the four Fashion-MNIST IDX files; default Debian's dataset-fashion-mnist);
#  5. `paratrain bench train --device cuda --model lenet`: paratrain's allreduce against DDP over Gloo with CUDA
#     tensors, and over NCCL where every worker has a GPU of its own (two workers share one GPU otherwise).
# Every step runs even if one before it failed; the exit status says whether all passed. Results go to $OUT
# (default: a new temp dir).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-gpu-XXXXXX)}
PY=${PY:-.venv/bin/python}
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
mkdir -p "$OUT"
status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; } | tee "$OUT/device.txt"
"$PY" -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'devices', torch.cuda.device_count(), 'nccl', d.is_nccl_available())" | tee -a "$OUT/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"
"$PY" -m pytest -q -m cuda tests/cuda --junitxml="$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.log" || status=1
"$PY" benchmarks/gpu/overlap.py "$OUT" 2>&1 | tee "$OUT/overlap.log" || status=1
"$PY" benchmarks/gpu/lenet.py "$OUT/lenet" --data-dir "$DATA_DIR" 2>&1 | tee "$OUT/lenet.log" || status=1
"$PY" -m paratrain.cli.main bench train --device cuda --model lenet --workers 2 --repeat 3 \
    --json "$OUT/bench-train-lenet.json" 2>&1 | tee "$OUT/bench-train-lenet.log" || status=1
echo "results in $OUT (exit $status)"
exit $status
