#!/usr/bin/env bash
# The device check: the CUDA data path on a host with one NVIDIA GPU, every log in OUT_DIR.
#
#   scripts/gpu_check.sh OUT_DIR
#
# For a bare GPU machine with Python 3.12 and torch with CUDA, no vLLM and no network:
#   1. the Python packages it lacks come as wheels in $PEGAFLOW_WHEELS (default .whl/,
#      made here by scripts/gpu_wheels.sh) and are installed into a private folder;
#   2. the gRPC stubs and the three native libraries are built in place for that Python;
#   3. pytest tests/gpu (every layout the connector pages, registered and bounced, more
#      chunks than bounce slots behind a forward, the worker's asynchronous path where vLLM
#      is installed (skipped on a bare machine), a request over the staging across a 1 GiB
#      piece, a refused registration) -> OUT_DIR/tests-gpu.log;
#   4. python bench/gpu.py (save/load vs pinned cudaMemcpy, the step with copies beside it,
#      the pool's registration rate) -> OUT_DIR/bench-gpu.log and OUT_DIR/bench-gpu.json.
# The host (nvidia-smi -L, kernel) is written to OUT_DIR/device.txt first, whatever fails
# later. Without CUDA (make test runs it so, so that it cannot rot) steps 1-3 run the same,
# every test of tests/gpu is skipped saying why, and step 4 is skipped with its reason; but
# where nvidia-smi lists a GPU that torch cannot use, the check fails, and with
# PEGAFLOW_REQUIRE_GPU=1 (on the device) so does a host where torch sees none: a run there
# must not pass by skipping. Exit 0 when every step passed or was skipped for want of a GPU.
# Budget: 6 minutes on a GPU; a hang ends at the step's bound (tests: 120 s each, a thread
# timer that fires inside a CUDA wait too, 300 s in all; bench: 180 s).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
wheels=${PEGAFLOW_WHEELS:-.whl}
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
t0=$(date +%s)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
{ echo "host $(uname -r); nvidia-smi: ${gpus:-0} GPU(s)"; nvidia-smi -L 2>/dev/null || true; } >"$out/device.txt"

if compgen -G "$wheels/*.whl" >/dev/null; then
    site=$(mktemp -d /tmp/pf-gpu-site.XXXXXX)
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
            >"$out/wheels.log" 2>&1; then
        note "FAIL wheels: pip could not install $wheels/*.whl (see wheels.log)"
        exit 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    note "wheels: $(ls "$wheels"/*.whl | wc -l) from $wheels installed into $site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# The stubs and native libraries of this checkout, for this Python (an install made them
# already where this is the development machine).
if ! "$PY" -c "import pegaflow._proto.node_pb2, pegaflow.client._pagecopy, pegaflow.core._sketch, pegaflow.core._blockindex, pegaflow.meta._metaview" \
        >/dev/null 2>&1; then
    if ! "$PY" -c "import grpc_tools" >/dev/null 2>&1; then
        note "FAIL build: no grpc_tools for $("$PY" -V 2>&1) and no wheels in $wheels (run scripts/gpu_wheels.sh on the development machine and carry .whl)"
        exit 1
    fi
    if ! "$PY" setup.py -q egg_info build_ext --inplace >"$out/build.log" 2>&1; then
        note "FAIL build: stubs or native libraries did not build for $("$PY" -V) (see build.log)"
        exit 1
    fi
    note "build: stubs and native libraries built in place for $("$PY" -V 2>&1)"
fi

"$PY" - >>"$out/device.txt" 2>&1 <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm_{p.major}{p.minor}")
    from pegaflow.client import cuda
    print("libcudart", cuda.find_cudart())
else:
    print("device none: torch.cuda.is_available() is False")
PY
note "$(cat "$out/device.txt" | tr '\n' ';')"
gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

rc=0
if [ "${gpus:-0}" -gt 0 ] && [ "$gpu" != 1 ]; then
    note "FAIL device: nvidia-smi lists ${gpus} GPU(s) but torch cannot use one (see device.txt): nothing below tests it"
    rc=1
elif [ "${PEGAFLOW_REQUIRE_GPU:-0}" = 1 ] && [ "$gpu" != 1 ]; then
    note "FAIL device: PEGAFLOW_REQUIRE_GPU=1 but torch sees no CUDA device (see device.txt): every test would skip"
    rc=1
fi
# -v -rA: every test's verdict and what it printed (registration rates, a raw refusal) in the log
timeout -k 10 300 "$PY" -m pytest -p no:cacheprovider -o timeout=120 -o timeout_method=thread -v -rA tests/gpu \
    >"$out/tests-gpu.log" 2>&1
t=$?
if [ $t = 0 ]; then
    note "tests/gpu: $(tail -n 1 "$out/tests-gpu.log")"
else
    note "FAIL tests/gpu: $([ $t = 124 ] && echo "timed out after 300 s;") $(tail -n 1 "$out/tests-gpu.log") (see tests-gpu.log)"
    rc=1
fi

if [ "$gpu" = 1 ]; then
    timeout -k 10 180 "$PY" bench/gpu.py --rounds 3 --steps 5 --summary "$out/bench-gpu.json" >"$out/bench-gpu.log" 2>&1
    t=$?
    if [ $t = 0 ]; then
        note "bench/gpu.py: $(grep -E '^(save|registered|[0-9]+-token)' "$out/bench-gpu.log" | tr '\n' ';')"
        # Its figures against bench/goals.py's GPU goals (reported, not the check's verdict).
        goals=$("$PY" -m bench --check gpu="$out/bench-gpu.json" 2>&1)
        note "bench/gpu.py goals: $([ $? = 0 ] && echo "all hold" || echo "NOT ALL HOLD")"
        echo "$goals" | grep '^| ' | tail -n +3 | tee -a "$summary"
    else
        note "FAIL bench/gpu.py: $([ $t = 124 ] && echo "timed out after 180 s;") $(tail -n 1 "$out/bench-gpu.log") (see bench-gpu.log)"
        rc=1
    fi
else
    note "bench/gpu.py skipped: no CUDA device (torch.cuda.is_available() is False)"
fi
note "gpu_check: rc $rc in $(($(date +%s) - t0)) s"
exit $rc
