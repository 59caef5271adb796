#!/usr/bin/env bash
# Horovod's own PyTorch MNIST example run on paratrain with only import lines changed (issue 17). Horovod's code
# is not shipped here: pass the path of examples/pytorch/pytorch_mnist.py from a clone of horovod/horovod
# (measured at commit 2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a):
#   bash benchmarks/horovod/run.sh /path/to/horovod/examples/pytorch/pytorch_mnist.py [EPOCHS]
# One process with batch 64 and lr 0.02, then 2 processes with batch 32 each (the same total batch; the script
# multiplies lr 0.01 by hvd.size()), with --fp16-allreduce, and with --use-adasum (lr 0.02, not scaled, as the
# example does for Adasum). Each run's output goes to benchmarks/horovod/<name>.txt.
set -euo pipefail
src=$1
epochs=${2:-3}
out=benchmarks/horovod
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python $out/port.py "$src" "$tmp/pytorch_mnist.py"
common=(--epochs "$epochs" --log-interval 100)
.venv/bin/python "$tmp/pytorch_mnist.py" "${common[@]}" --batch-size 64 --lr 0.02 | tee $out/one-process.txt
.venv/bin/paratrain launch -n 2 -- python "$tmp/pytorch_mnist.py" "${common[@]}" --batch-size 32 --lr 0.01 | tee $out/two-average.txt
.venv/bin/paratrain launch -n 2 -- python "$tmp/pytorch_mnist.py" "${common[@]}" --batch-size 32 --lr 0.01 --fp16-allreduce | tee $out/two-fp16.txt
.venv/bin/paratrain launch -n 2 -- python "$tmp/pytorch_mnist.py" "${common[@]}" --batch-size 32 --lr 0.02 --use-adasum | tee $out/two-adasum.txt
grep -H "Accuracy" $out/one-process.txt $out/two-*.txt
