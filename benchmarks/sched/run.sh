#!/usr/bin/env bash
# The commands behind benchmarks/sched/README.md, one at a time (2 cores: never two at once). From the repository
# root: bash benchmarks/sched/run.sh. Each writes its JSON and figure into benchmarks/sched/<name>/.
set -euo pipefail
b=benchmarks/sched
pt=.venv/bin/paratrain
# Lasso on Fashion-MNIST's pixels (strongly correlated features): STRADS vs random blocks (Shotgun), 4 workers
$pt sched lasso --data fashion-mnist --rows 10000 --alpha 0.001 --workers 4 --block 8 --max-updates 600000 --out $b/lasso-fmnist | tee $b/lasso-fmnist.txt
# Lasso on a wide correlated design where random blocks converge too: the updates ratio
$pt sched lasso --data correlated:1000x5000 --alpha 0.1 --workers 4 --block 8 --max-updates 2000000 --out $b/lasso-wide | tee $b/lasso-wide.txt
# Matrix factorisation: dense Fashion-MNIST (optimum = shrunk SVD) and a sparse power-law matrix
$pt sched mf --data fashion-mnist --rows 10000 --rank 10 --picks 400 --workers 4 --out $b/mf-fmnist | tee $b/mf-fmnist.txt
$pt sched mf --data power-law:20000x2000 --rank 10 --lam 5 --picks 100 --workers 4 --out $b/mf-powerlaw | tee $b/mf-powerlaw.txt
# PageRank by the chromatic engine against networkx and scipy
for g in debian power-law:20000 power-law:100000; do
  for w in 2 4; do
    $pt sched pagerank --graph $g --workers $w --sweeps 100 --out $b/pagerank-${g/:/-}-w$w | tee $b/pagerank-${g/:/-}-w$w.txt
  done
done
