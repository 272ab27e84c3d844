#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a GPU machine that has Python 3.12, torch with
# CUDA, grpcio, numpy, pytest, ... but not the rest of PegaFlow's runtime and no network.
#
#   scripts/gpu_wheels.sh [DIR]     (default .whl/, which git ignores)
#
# Downloads, here, the CPython 3.12 manylinux x86-64 wheels of the packages such a machine
# lacks, at the versions of requirements/test.txt (the lock CI installs), without their
# dependencies (each one they need is named here). About 15 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
PY=${PYTHON:-python3}
# Missing there (the device tool's package list): the node's and the connector's runtime
# beyond what a torch image holds. protobuf and grpcio travel too, so that the stubs built
# there with grpcio-tools match the protobuf runtime they load. liburing is not among them:
# the check runs no SSD tier (it is imported only by one), and its pinned release has no 3.12 wheel.
# setuptools travels too: the in-place build needs >= 77 (pyproject.toml's license string),
# and a torch image's may be older.
names=(structlog tenacity redis hiredis datasketches grpcio grpcio-tools grpcio-health-checking
       grpcio-reflection protobuf starlette uvicorn setuptools)
pins=()
for n in "${names[@]}"; do
    v=$(grep -iE "^${n}==" requirements/test.txt | head -n 1)
    [ -n "$v" ] || { echo "gpu_wheels: $n is not pinned in requirements/test.txt" >&2; exit 1; }
    pins+=("$v")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
PIP_CONSTRAINT="" "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir" "${pins[@]}"
for p in "${pins[@]}"; do  # pure-Python ones come as py3 wheels; each must be there once
    n=${p%%==*}
    count=$(ls "$dir" | grep -icE "^${n//-/_}-[0-9]" || true)
    [ "$count" = 1 ] || { echo "gpu_wheels: $count wheels of $n in $dir (want 1)" >&2; exit 1; }
done
echo "gpu_wheels: ${#pins[@]} wheels in $dir ($(du -sh "$dir" | cut -f1))"
