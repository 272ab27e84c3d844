"""Run every benchmark in its short mode and check every goal: ``python -m bench``.

    python -m bench [--only node,meta] [--skip ttft] [--out DIR]
    python -m bench --only concurrency,multiturn     # the long engine benchmarks (not in the default set)

Each benchmark runs as its own process (bench/<script>, arguments from bench/goals.py),
one after another on a machine that should be quiet, and writes its figures as JSON;
its output goes to DIR/<name>.log. Then one table: metric, measured value, the same-run
peer or physical limit, the ratio, the goal, and whether it holds. Exit status 1 when a
goal does not hold or a benchmark failed (its goals then count as not holding).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.goals import GOALS, RUNS, Goal, Run

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 420


def dig(d: Any, path: str | None) -> Any:
    if path is None:
        return None
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = int(next(x for x in Path("/proc/meminfo").read_text().splitlines()
                       if x.startswith("MemTotal")).split()[1]) >> 20
    except (OSError, StopIteration, ValueError):
        mem = 0
    return f"{cpu}, {os.cpu_count()} cores, {mem} GiB, {platform.system()} {platform.release()}"


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run_one(r: Run, out: Path) -> tuple[dict | None, float, str]:
    summary = out / f"{r.name}.json"
    log = out / f"{r.name}.log"
    argv = [sys.executable, str(ROOT / "bench" / r.script), *r.args, r.summary_flag, str(summary)]
    if r.root and os.geteuid() != 0:
        log.write_text("needs root (network namespaces)\n")
        return None, 0.0, "needs root"
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        try:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=RUN_TIMEOUT_S,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - t0, f"timed out after {RUN_TIMEOUT_S} s"
    took = time.monotonic() - t0
    if rc != 0 or not summary.exists():
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        return None, took, f"exit {rc}: {tail[0][:160]}"
    return json.loads(summary.read_text()), took, ""


def fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    if abs(x) >= 10_000:
        s = f"{x:,.0f}"
    elif abs(x) >= 100:
        s = f"{x:.0f}"
    elif abs(x) >= 1:
        s = f"{x:.2f}"
    else:
        s = f"{x:.3g}"
    return f"{s} {unit}".strip()


def evaluate(g: Goal, summary: dict | None) -> tuple[list[str], bool]:
    value = dig(summary, g.value)
    peer = dig(summary, g.peer)
    ratio = dig(summary, g.ratio) if g.ratio else (value / peer if value is not None and peer else None)
    checked = ratio if g.on == "ratio" else value
    sign = "≥" if g.higher_is_better else "≤"
    goal = f"{sign} {fmt(g.bound)}x" if g.on == "ratio" else f"{sign} {fmt(g.bound, g.unit)}"
    holds = checked is not None and (checked >= g.bound if g.higher_is_better else checked <= g.bound)
    peer_s = f"{fmt(peer, g.unit)} ({g.peer_name})" if g.peer else "—"
    return [g.metric, fmt(value, g.unit), peer_s, f"{ratio:.2f}x" if ratio is not None else "—", goal,
            "yes" if holds else "**no**"], holds


def print_goals(summaries: dict[str, dict | None]) -> bool:
    """The table of the goals of the runs in ``summaries``; True when every one holds."""
    print("| metric | measured | same-run peer / limit | ratio | goal | holds |")
    print("|---|---|---|---|---|---|")
    ok = True
    for g in GOALS:
        if g.run not in summaries:
            continue
        row, holds = evaluate(g, summaries[g.run])
        ok &= holds
        print("| " + " | ".join(row) + " |")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--skip", default="", help="comma-separated benchmark names")
    ap.add_argument("--out", type=Path, default=None, help="where logs and summaries go (default bench/out/<time>)")
    ap.add_argument("--check", metavar="RUN=SUMMARY", default="",
                    help="run nothing: judge RUN's goals on a summary it wrote already (e.g. "
                         "gpu=OUT/bench-gpu.json from scripts/gpu_check.sh); exit 1 if one fails")
    a = ap.parse_args()
    names = {r.name for r in RUNS}
    if a.check:
        name, _, path = a.check.partition("=")
        if name not in names or not path:
            ap.error(f"--check wants RUN=SUMMARY with RUN one of {', '.join(r.name for r in RUNS)}")
        try:
            summary = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--check: cannot read {path}: {exc}")
        sys.exit(0 if print_goals({name: summary}) else 1)
    only = {x for x in a.only.split(",") if x}
    skip = {x for x in a.skip.split(",") if x}
    unknown = (only | skip) - names
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(sorted(unknown))}; known: {', '.join(r.name for r in RUNS)}")
    # Long engine benchmarks run only when named (--only): the default set stays short.
    runs = [r for r in RUNS if (r.name in only if only else r.default) and r.name not in skip]
    out = a.out or ROOT / "bench" / "out" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, dict | None] = {}
    failures: dict[str, str] = {}
    t_all = time.monotonic()
    for i, r in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {r.name}: bench/{r.script} {' '.join(r.args)} ...", end=" ", flush=True)
        summaries[r.name], took, err = run_one(r, out)
        print(f"{took:.0f} s" + (f" FAILED ({err})" if err else ""), flush=True)
        if err:
            failures[r.name] = err
    total = time.monotonic() - t_all
    print(f"\n# python -m bench — commit {commit()}, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}; "
          f"{total / 60:.1f} min; logs in {out}\n")
    ok = print_goals(summaries) and not failures
    for name, err in failures.items():
        print(f"\n{name} failed: {err} (see {out / (name + '.log')})")
    node = summaries.get("node") or {}
    if "best_copy_gbps" in node:
        print(f"\nbest copy (the node rows' limit): {node['best_copy']}, one thread "
              f"{fmt(node['copy_1t_gbps'], 'GB/s')}, two threads {fmt(node['copy_2t_gbps'], 'GB/s')}")
    kernels = {k: v for k, v in node.items() if k.startswith("kernels_")}
    if kernels:
        print("\ncopy kernels chosen: " + "; ".join(f"{k[8:]}: {v}" for k, v in kernels.items()))
    sat = summaries.get("saturation") or {}
    rows = [f"{k[:-1]} KiB pages {fmt(v['saturation_requests_per_s'], 'requests/s')} "
            f"({fmt(v['saturation_rpcs_per_s'], 'RPCs/s')}, {fmt(v['saturation_gbps'], 'GB/s')} of pages)"
            for k, v in sat.items() if isinstance(v, dict) and "saturation_requests_per_s" in v]
    if rows:
        print(f"\none node's saturation with {sat.get('engines')} engine clients: " + "; ".join(rows))
    (out / "table.json").write_text(json.dumps({"commit": commit(), "machine": machine(), "ok": ok,
                                                "summaries": summaries, "failures": failures}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
