"""pytest plugin of ``make compat`` (``-p scripts.compat.plugin``): what each test observed.

Appends one JSON line per test to ``$PEGAFLOW_COMPAT_RESULTS``: its node id, outcome
(``passed``, ``failed``, ``error`` for a fixture that failed, ``skipped``), the first line
of what failed, and the numbers its engines reported (block size, the hit of each prompt,
the connector's metrics), read from the test's fixture values; nothing is asserted here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

# Metrics worth keeping (substrings of their names).
KEEP = ("pegaflow", "external_prefix_cache", "cached_by_source")


def observed(funcargs: dict[str, Any], live: bool = False) -> dict[str, Any]:
    """What the engines among a test's fixture values reported (``live``: ask them again)."""
    out: dict[str, Any] = {}
    for name, value in funcargs.items():
        if not hasattr(value, "block_size"):
            continue
        seen: dict[str, Any] = {"block_size": value.block_size}
        for attr in ("warm", "turn2"):
            got = getattr(value, attr, None)
            runs = [got] if isinstance(got, dict) else got if isinstance(got, list) else []
            if runs:
                seen[f"{attr}_cached_tokens"] = [r.get("num_cached_tokens") for r in runs]
        for attr in ("warm_metrics", "turn2_metrics"):
            m = getattr(value, attr, None)
            if isinstance(m, dict):
                seen[attr] = {k: v for k, v in m.items() if any(s in k for s in KEEP)}
        # The engine's counters now, after the test: a snapshot taken right after a request
        # can miss the stats of its last step (vLLM publishes them with a later one).
        proc = getattr(value, "proc", None)
        if live and callable(getattr(value, "metrics", None)) and proc is not None and proc.poll() is None:
            try:
                seen["metrics_after"] = {k: v for k, v in value.metrics().items() if any(s in k for s in KEEP)}
            except Exception as exc:  # noqa: BLE001 - an observation, never a test result
                seen["metrics_after"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        out[name] = seen
    return out


def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get("PEGAFLOW_COMPAT_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep: pytest.TestReport = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and not rep.passed):
        status = rep.outcome if rep.when == "call" or rep.skipped else "error"
        why = ""
        if call.excinfo is not None and not rep.skipped:
            why = call.excinfo.exconly().strip().splitlines()[0][:300]
        elif rep.skipped and isinstance(rep.longrepr, tuple):
            why = str(rep.longrepr[2])[:300]
        _record({"test": item.nodeid, "outcome": status, "why": why, "seconds": round(rep.duration, 1),
                 "observed": observed(getattr(item, "funcargs", {}), live=rep.when == "call")})
