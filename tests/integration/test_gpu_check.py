"""The device check (scripts/gpu_check.sh) runs here in its CPU mode, so it cannot rot before a
GPU runs it: it finds this checkout's build, collects every test of tests/gpu (each skipped
with its reason, none erroring at import), skips the GPU benchmark saying why, and writes
its summary and logs where it is told."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the check for real (scripts/gpu_check.sh)")
def test_the_device_check_runs_in_cpu_mode_and_says_what_it_skipped(tmp_path: Path) -> None:
    env = {**os.environ, "PEGAFLOW_WHEELS": str(tmp_path / "no-wheels")}  # this machine has every package
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    out = tmp_path / "out"
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (out / "summary.txt").read_text()
    assert "device none" in summary
    assert "bench/gpu.py skipped: no CUDA device" in summary
    log = (out / "tests-gpu.log").read_text()
    skipped = re.search(r"(\d+) skipped", log)
    assert skipped and int(skipped.group(1)) >= 20, log
    assert not re.search(r"\d+ (failed|error)", log), log
    assert "no CUDA device" in log, "the skip reason is printed"
    assert re.search(r"gpu_check: rc 0 in \d+ s", summary)
