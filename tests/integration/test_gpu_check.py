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
    device = (out / "device.txt").read_text()
    assert re.search(r"^host \S+; nvidia-smi: 0 GPU\(s\)", device, re.M), device


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the check for real (scripts/gpu_check.sh)")
def test_a_gpu_that_torch_cannot_use_fails_the_check_rather_than_skipping_everything(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # the driver sees a GPU; this torch (CPU) cannot use it
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PEGAFLOW_WHEELS": str(tmp_path / "no-wheels"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert r.returncode == 1, summary
    assert "FAIL device: nvidia-smi lists 1 GPU(s) but torch cannot use one" in summary
    assert "H100" in (tmp_path / "out" / "device.txt").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host runs the check for real (scripts/gpu_check.sh)")
def test_a_run_that_requires_a_gpu_fails_where_torch_sees_none(tmp_path: Path) -> None:
    """On the device the check runs with PEGAFLOW_REQUIRE_GPU=1: a host whose GPU neither
    nvidia-smi nor torch sees must not pass by skipping every test."""
    env = {**os.environ, "PEGAFLOW_WHEELS": str(tmp_path / "no-wheels"), "PEGAFLOW_REQUIRE_GPU": "1",
           "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert r.returncode == 1, summary
    assert "FAIL device: PEGAFLOW_REQUIRE_GPU=1 but torch sees no CUDA device" in summary
