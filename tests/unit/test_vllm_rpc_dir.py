"""Where engines started by the harness (tests and benchmarks) put vLLM's IPC sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import os; from tests.harness.dirs import vllm_rpc_dir; p = vllm_rpc_dir(); print(p, os.path.isdir(p))"


def probe(env: dict[str, str]) -> tuple[str, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, check=True).stdout.split()
    return out[0], out[1] == "True"


def test_a_run_outside_pytest_gets_its_own_directory_removed_at_exit() -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    path, existed = probe(env)
    assert existed and Path(path).name.startswith("pf-vllm-rpc-")
    assert not Path(path).exists()  # removed when the process exited


def test_a_directory_already_set_is_used_and_kept(tmp_path: Path) -> None:
    path, existed = probe({**os.environ, "VLLM_RPC_BASE_PATH": str(tmp_path)})
    assert path == str(tmp_path) and existed and tmp_path.is_dir()
