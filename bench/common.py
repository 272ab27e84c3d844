"""Helpers several benchmarks share."""

from __future__ import annotations

import os
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
