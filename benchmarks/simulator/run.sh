#!/usr/bin/env bash
# The commands behind benchmarks/simulator/README.md, one after the other (each uses both cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/paratrain-simulator-XXXXXX)}
P=${PARATRAIN:-.venv/bin/paratrain}
HERE=benchmarks/simulator

# 1. the machine profile: the transport paths and the three models, measured with 4 processes at once
$P profile --model mlp --model lenet --model widemlp --dataset fashion-mnist --workers 4 --out "$HERE/machine.json"
# 2. predicted vs measured: 3 models x 2 emulated networks x allreduce and the parameter server, 2 rounds; then the
#    hybrids on the FC models; then ASP, fp16-compressed allreduce and gossip; then all measurements predicted by the same
#    simulator in one table
$P bench simulator --machine "$HERE/machine.json" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit \
    --strategies allreduce,bsp --steps 8 --repeat 2 --out "$OUT/validation" --json "$HERE/validation-measured.json"
$P bench simulator --machine "$HERE/machine.json" --models mlp,widemlp --networks 1Gbit,100Mbit \
    --strategies poseidon:allreduce,sfb --steps 8 --repeat 2 --out "$OUT/validation-hybrid" \
    --json "$HERE/validation-hybrid-measured.json"
$P bench simulator --machine "$HERE/machine.json" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit \
    --strategies asp,allreduce+fp16,gossip:ring --steps 8 --repeat 2 --out "$OUT/validation-more" \
    --json "$HERE/validation-more-measured.json"
$P bench simulator --machine "$HERE/machine.json" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit \
    --strategies ssp:2 --steps 8 --repeat 2 --out "$OUT/validation-ssp" --json "$HERE/validation-ssp-measured.json"
$P bench simulator --machine "$HERE/machine.json" --measured "$HERE/validation-measured.json" \
    --measured "$HERE/validation-hybrid-measured.json" --measured "$HERE/validation-more-measured.json" \
    --json "$HERE/validation.json"
# 2b. pipelines (GPipe and 1F1B, one stage per worker, 4 micro-batches of 64) with a profile that records the
#     models' module structure (the first profile predates it)
$P profile --model mlp --model lenet --model widemlp --dataset fashion-mnist --workers 4 \
    --out "$HERE/machine-pipeline.json"
$P bench simulator --machine "$HERE/machine-pipeline.json" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit \
    --strategies pipeline:gpipe,pipeline:1f1b --steps 8 --repeat 2 --out "$OUT/validation-pipeline" \
    --json "$HERE/validation-pipeline.json"
# 2c. (second session) a profile that also times each model's step alone (core sharing) and the input's size; the
#     pipelines measured again after the runtime stopped sending gradients to a Flatten stage; all 50 rows
#     predicted from it. Profile on a quiet machine: nothing else may run meanwhile.
$P profile --model mlp --model lenet --model widemlp --dataset fashion-mnist --workers 4 --out "$HERE/machine-cores.json"
$P bench simulator --machine "$HERE/machine-cores.json" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit \
    --strategies pipeline:gpipe,pipeline:1f1b --steps 8 --repeat 2 --out "$OUT/validation-pipeline-cores" \
    --json "$HERE/validation-pipeline-cores-measured.json"
$P bench simulator --machine "$HERE/machine-cores.json" --measured "$HERE/validation-pipeline-cores-measured.json" \
    --json "$HERE/validation-pipeline-cores.json"
$P bench simulator --machine "$HERE/machine-cores.json" --measured "$HERE/validation-measured.json" \
    --measured "$HERE/validation-hybrid-measured.json" --measured "$HERE/validation-more-measured.json" \
    --json "$HERE/validation-cores.json"
# 3. the planner on a communication-bound job, confirmed by real runs
$P plan --machine "$HERE/machine.json" --model widemlp --workers 4 --bandwidth 100Mbit --run --confirm 1 --steps 8 \
    --json "$HERE/plan-widemlp-100m.json"
$P plan --machine "$HERE/machine-pipeline.json" --model widemlp --workers 4 --bandwidth 100Mbit --run --confirm 1 \
    --steps 8 --json "$HERE/plan-widemlp-100m-pipelines.json"
$P plan --machine "$HERE/machine-cores.json" --model widemlp --workers 4 --bandwidth 100Mbit --run --confirm 1 \
    --steps 8 --json "$HERE/plan-widemlp-100m-cores.json"
# 4. the fusion size picked by the simulator (no warm-up) against a measured grid: widemlp, 1 Gbit/s, 2 rounds
$P bench simulator --machine "$HERE/machine.json" --models widemlp --networks 1Gbit --steps 8 --repeat 2 \
    --bucket-grid 256KiB,1MiB,4MiB,16MiB,64MiB --out "$OUT/buckets" --json "$HERE/buckets.json"
# 5. beyond this machine: 2 ... 1024 workers on 10 Gbit/s links, 100 MB per worker
$P bench scaling --size 100MB --bandwidth 10Gbit --latency 10us --plot "$HERE/scaling.png" --json "$HERE/scaling.json"
# 5b. the figure's ring and tree checked here at N = 2..4: measured under the fault injector beside the simulation
$P bench scaling --check --machine "$HERE/machine.json" --size 4MB --bandwidth 1Gbit --latency 0 --workers 2,3,4 \
    --repeat 3 --json "$HERE/scaling-check.json"
# 6. one training step of N workers (widemlp, ring allreduce), and how long simulating it takes
$P bench scaling --step widemlp --machine "$HERE/machine.json" --workers 4,16,64,256,1024 --bandwidth 10Gbit \
    --latency 10us --json "$HERE/scaling-step.json"
# 7. (issue 18, final code, a re-created machine) a fresh profile and every table again from it
M=$HERE/machine-final.json
$P profile --model mlp --model lenet --model widemlp --dataset fashion-mnist --workers 4 --out "$M"
$P bench simulator --machine "$M" --models mlp,lenet --networks 1Gbit,100Mbit --strategies allreduce,bsp --steps 8 \
    --repeat 1 --out "$OUT/final" --json "$HERE/validation-final.json"
$P bench simulator --machine "$M" --models widemlp --networks 1Gbit,100Mbit --strategies allreduce,bsp --steps 8 \
    --repeat 2 --out "$OUT/final-wide" --json "$HERE/validation-final-wide-measured.json"
$P bench simulator --machine "$M" --models mlp,widemlp --networks 1Gbit,100Mbit --strategies poseidon:allreduce,sfb \
    --steps 8 --repeat 2 --out "$OUT/final-hybrid" --json "$HERE/validation-final-hybrid-measured.json"
$P bench simulator --machine "$M" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit \
    --strategies asp,allreduce+fp16,gossip:ring --steps 8 --repeat 2 --out "$OUT/final-more" \
    --json "$HERE/validation-final-more-measured.json"
$P bench simulator --machine "$M" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit \
    --strategies pipeline:gpipe,pipeline:1f1b --steps 8 --repeat 2 --out "$OUT/final-pipeline" \
    --json "$HERE/validation-final-pipeline-measured.json"
$P bench simulator --machine "$M" --measured "$HERE/validation-final.json" \
    --measured "$HERE/validation-final-wide-measured.json" --measured "$HERE/validation-final-hybrid-measured.json" \
    --measured "$HERE/validation-final-more-measured.json" --measured "$HERE/validation-final-pipeline-measured.json" \
    --json "$HERE/validation-final-all.json"
$P plan --machine "$M" --model widemlp --workers 4 --bandwidth 100Mbit --run --confirm 1 --steps 8 \
    --json "$HERE/plan-widemlp-100m-final.json"
$P bench simulator --machine "$M" --models widemlp --networks 1Gbit --steps 8 --repeat 2 \
    --bucket-grid 256KiB,1MiB,4MiB,16MiB,64MiB --out "$OUT/final-buckets" --json "$HERE/buckets-final.json"
$P bench scaling --check --machine "$M" --size 4MB --bandwidth 1Gbit --latency 0 --workers 2,3,4 --repeat 3 \
    --json "$HERE/scaling-check-final.json"
$P bench scaling --step widemlp --machine "$M" --workers 4,16,64,256,1024 --bandwidth 10Gbit --latency 10us \
    --json "$HERE/scaling-step-final.json"
$P bench simulator --machine "$M" --models mlp,lenet,widemlp --networks 1Gbit,100Mbit --strategies ssp:2 --steps 8 \
    --repeat 1 --out "$OUT/final-ssp" --json "$HERE/validation-final-ssp-measured.json"
echo "results in $OUT"
