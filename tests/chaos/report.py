"""Render chaos figures (JSON lines from ``PEGAFLOW_CHAOS_REPORT``) as the table of docs/reliability.md.

A figure a scenario did not compute (``lost`` where it cannot tell a lost block from an
evicted one) is rendered "—", never as a number.

    python -m tests.chaos.report FILE
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    cols = ("scenario", "intensity", "tried", "failed", "lost", "wrong", "crashes", "tracebacks", "leaked", "seconds")
    print("| " + " | ".join(cols) + " | notes |")
    print("|" + "---|" * (len(cols) + 1))
    for r in rows:
        notes = ", ".join(f"{k} {v}" for k, v in r.get("notes", {}).items())
        print("| " + " | ".join("—" if r[c] is None else str(r[c]) for c in cols) + f" | {notes} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
