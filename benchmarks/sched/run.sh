#!/usr/bin/env bash
# The benchmarks behind benchmarks/sched/README.md, one after another (2 cores: never two at once). From the
# repository root: bash benchmarks/sched/run.sh. `paratrain bench sched --dry-run` prints the commands it runs;
# each writes its JSON and figure into benchmarks/sched/<name>/ and its printed tables into <name>.txt.
set -euo pipefail
.venv/bin/paratrain bench sched --out benchmarks/sched "$@"
