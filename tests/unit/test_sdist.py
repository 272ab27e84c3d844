"""The source distribution carries what a build from it needs: ``proto/`` (setup.py makes the
gRPC stubs from it; an sdist without it built a package whose every command failed with
ImportError, and setup.py now refuses to build without it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sdist_holds_the_protos_the_build_makes_the_stubs_from(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    for rel in filter(None, files.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / rel)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=tree, check=True,
                   capture_output=True, timeout=300)
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    protos = sorted(p.name for p in (ROOT / "proto").glob("*.proto"))
    assert protos and sorted(Path(n).name for n in names if "/proto/" in n and n.endswith(".proto")) == protos
