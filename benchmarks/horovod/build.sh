#!/usr/bin/env bash
# Builds Horovod 0.28.1 (the latest on PyPI) from its source distribution against this venv's torch, CPU only,
# with Gloo, for the anchors of `paratrain bench train` and `paratrain bench allreduce` (issue 18).
#
# As shipped it does not build here: its CMake files ask for C++14 (CMakeLists.txt line 19, and
# horovod/torch/CMakeLists.txt line 67) and torch 2.13's headers need C++17. The one fix: both set C++17.
# Needs cmake and g++ (Debian: apt-get install cmake g++); about 15 minutes on 2 cores.
#   bash benchmarks/horovod/build.sh            # then: .venv/bin/horovodrun --check-build
set -euo pipefail
venv=${VENV:-.venv}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/pip" download --no-deps --no-binary :all: horovod==0.28.1 -d "$work"
tar xzf "$work/horovod-0.28.1.tar.gz" -C "$work"
src="$work/horovod-0.28.1"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO MAKEFLAGS=-j2 \
  "$venv/bin/pip" wheel --no-build-isolation --no-deps -w "$work/wheel" "$src"
"$venv/bin/pip" install --no-deps "$work"/wheel/horovod-*.whl
"$venv/bin/pip" install cloudpickle psutil pyyaml  # horovodrun's own dependencies
"$venv/bin/horovodrun" --check-build
