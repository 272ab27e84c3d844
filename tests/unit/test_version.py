"""Every console script answers ``-V`` and ``--version`` with its name and the installed
distribution's version, exit 0, as the original's binaries do (``pega-engine-server 0.25.1``);
``pegaflow.__version__`` is the same number. The scripts are read from pyproject.toml, so a
new one is covered."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib

import pytest

import pegaflow
from tests.harness.procs import REPO, python_env

SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
# The entry point, called as its console script would be (sys.argv[0] is the script's name).
RUN = "import sys, importlib; m, f = sys.argv[1].split(':'); sys.argv = sys.argv[2:]; getattr(importlib.import_module(m), f)()"


def installed() -> str:
    return importlib.metadata.version("pegaflow")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_every_console_script_prints_its_version(script: str, flag: str) -> None:
    r = subprocess.run([sys.executable, "-c", RUN, SCRIPTS[script], script, flag], capture_output=True, text=True,
                       timeout=60, cwd=REPO, env=python_env())
    assert r.returncode == 0, r.stderr
    name, _, version = r.stdout.strip().rpartition(" ")
    assert name.startswith("pegaflow") and version == installed(), r.stdout


def test_the_package_has_its_version() -> None:
    assert pegaflow.__version__ == installed()
    with pytest.raises(AttributeError):
        pegaflow.no_such_attribute  # noqa: B018
