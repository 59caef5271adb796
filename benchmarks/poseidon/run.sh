#!/usr/bin/env bash
# The commands behind benchmarks/poseidon/README.md, in the order they were run (one after the other: each one
# uses both cores). Results go to $OUT (default: a new temp dir). The DDP anchor throttled by tc needs root.
# The README's final-code section (issue 18) ran these commands again, except 3c, from 2026-11-26 23:41 UTC (widemlp's
# 4-epoch run with top-k and DGC in one command); its JSON files are the *-final.json ones here.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-poseidon-XXXXXX)}
P=${PARATRAIN:-.venv/bin/paratrain}
S=bsp,allreduce,sfb,poseidon,poseidon:allreduce,allreduce+fp16,allreduce+topk:0.01,allreduce+powersgd:4
MIX=allreduce+powersgd:4,poseidon:allreduce+powersgd:4,allreduce+topk:0.01,poseidon:allreduce+topk:0.01

# 1. bytes per layer and step on the sockets against the cost model
$P bench sfb-bytes --json "$OUT/bytes.json"
# 2. step time on an emulated 100 Mbit/s network, 4 workers, 3 rounds interleaved: widemlp 8 steps, LeNet-5 40
$P compare --model widemlp --dataset fashion-mnist --workers 4 --bandwidth 100Mbit --steps-per-epoch 8 \
    --epochs 1 --repeat 3 --strategies $S --out "$OUT/wide-100m" --json "$OUT/wide-100m.json"
$P compare --model widemlp --dataset fashion-mnist --workers 4 --bandwidth 100Mbit --steps-per-epoch 8 \
    --epochs 1 --repeat 3 --strategies $MIX --out "$OUT/wide-100m-mix" --json "$OUT/wide-100m-mix.json"
$P compare --model lenet --dataset fashion-mnist --workers 4 --bandwidth 100Mbit --steps-per-epoch 40 \
    --epochs 1 --repeat 3 --strategies $S,poseidon:allreduce+powersgd:4,poseidon:allreduce+topk:0.01 \
    --out "$OUT/lenet-100m-40" --json "$OUT/lenet-100m-40.json"
# median step time after the first, per strategy: python benchmarks/poseidon/steps.py "$OUT/wide-100m" (etc.)
# 3. accuracy and time to accuracy: widemlp 200 steps at 1 Gbit/s (80 %), LeNet-5 400 steps on both networks (70 %)
$P compare --model widemlp --dataset fashion-mnist --workers 4 --bandwidth 1Gbit --steps-per-epoch 50 --epochs 4 \
    --target-accuracy 0.8 --strategies $S --out "$OUT/wide-1g" --json "$OUT/wide-1g.json"
$P compare --model lenet --dataset fashion-mnist --workers 4 --bandwidth 1Gbit --steps-per-epoch 100 --epochs 4 \
    --target-accuracy 0.7 --strategies $S --out "$OUT/lenet-1g" --json "$OUT/lenet-1g.json"
$P compare --model lenet --dataset fashion-mnist --workers 4 --bandwidth 100Mbit --steps-per-epoch 100 --epochs 4 \
    --target-accuracy 0.7 --strategies $S --out "$OUT/lenet-100m-tta" --json "$OUT/lenet-100m-tta.json"
# 3b. (2026-11-26) does top-k catch up? 4 epochs with no emulated network; DGC's momentum correction; DGC at 1 Gbit/s
$P compare --model widemlp --dataset fashion-mnist --workers 4 --epochs 4 --target-accuracy 0.8 \
    --strategies allreduce,allreduce+topk:0.01 --out "$OUT/wide-4epochs" --json "$OUT/wide-4epochs.json"
$P compare --model widemlp --dataset fashion-mnist --workers 4 --epochs 4 --target-accuracy 0.8 \
    --strategies allreduce+dgc:0.01 --out "$OUT/wide-4epochs-dgc" --json "$OUT/wide-4epochs-dgc.json"
$P compare --model widemlp --dataset fashion-mnist --workers 4 --bandwidth 1Gbit --steps-per-epoch 50 --epochs 4 \
    --target-accuracy 0.8 --strategies allreduce+dgc:0.01 --out "$OUT/wide-1g-dgc" --json "$OUT/wide-1g-dgc.json"
# 3c. (2026-11-26) widemlp's time to 80 % on the 100 Mbit/s network, 125 steps, evaluated every 25
$P compare --model widemlp --dataset fashion-mnist --workers 4 --bandwidth 100Mbit --steps-per-epoch 25 --epochs 5 \
    --target-accuracy 0.8 --strategies $S,allreduce+dgc:0.01 --out "$OUT/wide-100m-tta" --json "$OUT/wide-100m-tta.json"
# 4. wait-free backprop off and on, 1 Gbit/s
for overlap in --no-overlap ""; do
    $P compare --model widemlp --dataset fashion-mnist --workers 4 --bandwidth 1Gbit --steps-per-epoch 20 --epochs 1 \
        --repeat 3 $overlap --strategies allreduce,poseidon:allreduce,bsp --out "$OUT/overlap${overlap}" \
        --json "$OUT/overlap${overlap}.json"
done
# 5. the anchor: torch DDP with its compression hooks, loopback throttled to 100 Mbit/s, then unthrottled for accuracy
$P bench ddp-anchor --hooks none,fp16,powersgd:4 --workers 4 --rate 100mbit --steps-per-epoch 8 --epochs 1 --repeat 3 \
    --json "$OUT/ddp-100m.json"
$P bench ddp-anchor --hooks none,fp16,powersgd:4 --workers 4 --steps-per-epoch 50 --epochs 4 --json "$OUT/ddp-acc.json"
# 5b. (2026-11-26) PowerSGD against DDP's hook, interleaved, 3 rounds of 20 steps at 100 Mbit/s
for r in 1 2 3; do
    $P bench ddp-anchor --hooks powersgd:4 --workers 4 --rate 100mbit --steps-per-epoch 20 --epochs 1 \
        --json "$OUT/psgd-ddp-$r.json"
    $P compare --model widemlp --dataset fashion-mnist --workers 4 --bandwidth 100Mbit --steps-per-epoch 20 --epochs 1 \
        --strategies allreduce+powersgd:4,poseidon:allreduce+powersgd:4 --out "$OUT/psgd-pt-$r" --json "$OUT/psgd-pt-$r.json"
done
echo "results in $OUT"
