"""Helpers several benchmarks share."""

from __future__ import annotations

import json
import os
import time
import urllib.request


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> dict[str, float]:
    """A Prometheus /metrics page as {"name|label=value|...": value} (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


class Streamed:
    """Time to first token and cached prompt tokens of one OpenAI streamed completion, fed
    its server-sent-event lines as they arrive (``stream_options.include_usage`` for the
    cached tokens). Started when constructed: make it just before sending the request."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.cached = 0

    def feed(self, line: str) -> None:
        line = line.strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            return
        chunk = json.loads(line[5:])
        if self.first is None and chunk.get("choices"):
            self.first = time.perf_counter() - self.t0
        details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
        self.cached = int(details.get("cached_tokens") or self.cached)

    def ttft_s(self, who: str) -> float:
        if self.first is None:
            raise RuntimeError(f"{who}: no token streamed")
        return self.first
