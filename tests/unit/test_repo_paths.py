"""Nothing in the repository points outside it: a user has only what `git clone` gives."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".proto", ".toml", ".txt", ".cfg", ".conf", ".c", ".json", ".yml", ".yaml", ""}
# A relative path that climbs out of the directory it is written in: "../x", '../../x'.
SHARED = "../" + "shared"  # spelled in two parts so that this file does not match itself
CLIMB = re.compile(r"""(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)""")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / p for p in out.decode().split("\0") if p]
    assert len(files) > 50, "git ls-files found too little: is this a checkout?"
    return [f for f in files if f.suffix in TEXT_SUFFIXES and f.is_file()]


def outside(base: Path, rel: str) -> bool:
    return not (base / rel).resolve().is_relative_to(ROOT)


def test_no_tracked_file_refers_to_a_path_outside_the_repository():
    bad = []
    for f in tracked_files():
        text = f.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            if SHARED in line:
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
                continue
            for rel in CLIMB.findall(line):
                if outside(f.parent, rel):
                    bad.append(f"{f.relative_to(ROOT)}:{i}: {rel}")
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)


def test_relative_links_in_docs_resolve_inside_the_repository():
    bad = []
    for f in tracked_files():
        if f.suffix != ".md":
            continue
        for target in MD_LINK.findall(f.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#", 1)[0]
            if outside(f.parent, path) or not (f.parent / path).exists():
                bad.append(f"{f.relative_to(ROOT)}: {target}")
    assert not bad, "broken or outside links:\n" + "\n".join(bad)


def test_the_checker_sees_a_climb_out_of_the_repository(tmp_path):
    # The rule itself can fail: a path two levels above tests/unit/ is the repo root's parent.
    out = "../../" + SHARED + "/DESIGN.md"
    assert CLIMB.findall(f'x = "{out}"') == [out]
    assert outside(ROOT / "tests" / "unit", out)
    assert not outside(ROOT / "docs", "../traces/README.md")


REPO_PATH = re.compile(r"(?<![\w/.-])((?:pegaflow|tests|bench|scripts|infra|docs|proto)/[\w./-]*[\w/])")


def test_every_repository_path_the_docs_name_exists():
    # Modules move (pegaflow/meta/events/, pegaflow/policy/); a doc that names the old place
    # sends a reader nowhere.
    missing = []
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for m in REPO_PATH.finditer(line):
                path = m.group(1)  # not after a "/": /var/log/pegaflow/... is not the repo's
                if not (ROOT / path).exists():
                    missing.append(f"{f.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)
