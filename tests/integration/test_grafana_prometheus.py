"""docs/grafana/pegaflow.json against a real Prometheus (Debian's ``prometheus``): it scrapes
a live node (SSD tier, publishing to Redis), a metaserver and a router in front of a
stand-in engine, every second; after some traffic, every target expression of every panel
is evaluated through Prometheus's HTTP API, and a panel whose query returns no series fails
the test, named.

The Rust original's own dashboard (its queries: tests/original_dashboard.py) against a live
node with the same traffic and an engine's connector saving and loading through it: a query
shows data when Grafana would draw something, i.e. a finite value at some point of the
traffic's time range. At least 41 of its 46 do, and only those of series that have no
meaning here may stay empty (docs/metrics.md, "The original's names")."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness.http import HTTP
from tests.harness.meta import MetaServer
from tests.harness.ports import free_port
from tests.harness.redis import RedisServer
from tests.harness.router import FakeEngine, RouterProc
from tests.integration import redis_fixtures
from tests.integration.metrics_stack import drive, drive_engine, drive_node, node_args, start_metaserver
from tests.original_dashboard import ABSENT_HERE, ORIGINAL_DASHBOARD_QUERIES
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pegaflow.json"
SCRAPE_S = 1
START_S = 30.0  # Prometheus's start, and its first scrape of every target
# Grafana's variables, as Grafana would set them for a short range: $__rate_interval is at
# least four scrape intervals; the dashboard's own variables (node, window) select all.
VARIABLES = {
    "$__rate_interval": "10s",
    "$__interval": "2s",
    "$__range": "1m",
    "$instance": ".*",
    "$window": ".*",
}
# The original's dashboard: its one variable at its default, the same rate interval.
ORIGINAL_VARIABLES = {"$__rate_interval": "10s", "$reason": "pressure"}
# The bar (#56): the original's dashboard shows data in at least this many of its queries.
ORIGINAL_MIN_WITH_DATA = 41


def panel_queries(dash: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every target of every panel, rows' panels included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", "?"), t.get("refId", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def variable_queries(dash: dict) -> list[tuple[str, str, str]]:
    """(variable, metric, label) of every ``label_values(metric, label)`` variable."""
    out = []
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q or ""
        m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*", q)
        if v.get("type") == "query":
            assert m, f"variable {v.get('name')}: a query the test does not know: {q!r}"
            out.append((v["name"], m.group(1), m.group(2)))
    return out


def substitute(expr: str, variables: dict[str, str] = VARIABLES) -> str:
    for var, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + var[1:] + "}", value).replace(var, value)
    left = re.findall(r"\$\{?\w+", expr)
    assert not left, f"a Grafana variable the test does not know: {left} in {expr}"
    return expr


class Prometheus:
    def __init__(self, tmp: Path, targets: dict[str, str]) -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            pytest.fail("prometheus is not installed (scripts/install.sh test installs Debian's)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        jobs = [{"job_name": job, "scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                 "static_configs": [{"targets": [addr]}]} for job, addr in targets.items()]
        config.write_text(json.dumps({"global": {"scrape_interval": f"{SCRAPE_S}s",
                                                 "evaluation_interval": f"{SCRAPE_S}s"},
                                      "scrape_configs": jobs}))  # JSON is YAML
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'prometheus-data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip

    def query(self, expr: str) -> list[dict]:
        r = HTTP.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body.get("status") == "success", f"{expr}: {body.get('error') or r.text}"
        return body["data"]["result"]

    def drawn(self, expr: str, start: float) -> bool:
        """Whether Grafana would draw ``expr`` over [start, now]: some series has a finite
        value at some step (a quantile of no observations is NaN: nothing to draw)."""
        r = HTTP.get(self.url + "/api/v1/query_range",
                      params={"query": expr, "start": start, "end": time.time(), "step": SCRAPE_S}, timeout=10)
        body = r.json()
        assert body.get("status") == "success", f"{expr}: {body.get('error') or r.text}"
        return any(math.isfinite(float(v)) for series in body["data"]["result"] for _, v in series["values"])

    def label_values(self, metric: str, label: str) -> set[str]:
        """What Grafana's ``label_values(metric, label)`` lists."""
        r = HTTP.get(self.url + f"/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10)
        body = r.json()
        assert body.get("status") == "success", f"label_values({metric}, {label}): {r.text}"
        return set(body["data"])

    def all_up(self, jobs: set[str]) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        if HTTP.get(self.url + "/-/ready", timeout=10).status_code != 200:
            return False  # starting: its API answers 503 "Service Unavailable" until the storage is open
        up = {s["metric"]["job"]: s["value"][1] for s in self.query("up")}
        return set(up) == jobs and all(v == "1" for v in up.values())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def metaserver(tmp_path: Path, redis_server: RedisServer) -> Iterator[MetaServer]:
    m = start_metaserver(tmp_path, redis_server.url)
    yield m
    m.stop()


def test_every_dashboard_panel_returns_series_from_a_real_prometheus(
    node_factory, metaserver: MetaServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    node = node_factory(pool_size="1mb", extra=node_args(tmp_path, redis_server.url))
    engine = FakeEngine(tmp_path, "e0", "--node", "metrics-node", "--node-addr", node.addr)
    router = RouterProc(tmp_path, "--engine", engine.url, "--policy", "kv-aware", "--hint-timeout", "2",
                        "--skip-tokenizer-init")
    prom = Prometheus(tmp_path, {"node": f"127.0.0.1:{node.http_port}",
                                 "meta": f"127.0.0.1:{metaserver.http_port}",
                                 "router": f"127.0.0.1:{router.port}"})
    try:
        wait_until(lambda: prom.all_up({"node", "meta", "router"}), START_S,
                   lambda: f"Prometheus to scrape node, meta and router (up == 1): {prom.log.read_text()[-2000:]}",
                   every=0.2, ignore=httpx.HTTPError)
        drive(node, metaserver)
        for i in range(4):
            r = router.post("/v1/completions", {"model": "fake-model", "prompt": f"hello {i}", "max_tokens": 2,
                                                "stream": i % 2 == 1})
            assert r.status_code == 200, r.text
        dash = json.loads(DASHBOARD.read_text())
        queries = [(title, ref, substitute(expr)) for title, ref, expr in panel_queries(dash)]
        assert len(queries) >= 30, "the dashboard's panels were not all read"

        def empty() -> list[str]:
            return [f"{title} [{ref}]: {expr}" for title, ref, expr in queries if not prom.query(expr)]

        # Two scrapes after the traffic are enough for rate() over $__rate_interval; the
        # node refreshes its window gauges every 5 s. Bounded: what stays empty fails.
        left: list[str] = []

        def all_have_series() -> bool:
            nonlocal left
            left = empty()
            return not left

        try:
            wait_until(all_have_series, 20, "every panel to return series", every=1.0)
        except AssertionError:
            pytest.fail("panels whose query returns no series:\n  " + "\n  ".join(left))
        # The dashboard's variables (node, window) list values, or every panel would be empty.
        variables = variable_queries(dash)
        assert {name for name, _, _ in variables} >= {"instance", "window"}
        for name, metric, label in variables:
            assert prom.label_values(metric, label), f"variable ${name}: label_values({metric}, {label}) is empty"
        assert prom.label_values("pegaflow_node_pool_capacity_bytes", "instance") == {f"127.0.0.1:{node.http_port}"}
        # The default windows under the original's labels: its dashboards filter on window="1d".
        for metric in ("pegaflow_node_ceiling_hit_ratio", "pegaflow_hll_estimated_hit_rate"):
            assert prom.label_values(metric, "window") == {"15m", "1h", "1d"}, metric
    finally:
        prom.stop()
        router.stop()
        engine.stop()


def test_the_originals_own_dashboard_shows_data_in_at_least_41_of_its_46_queries(node_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = node_factory(pool_size="1mb", extra=node_args(tmp_path, None))
    prom = Prometheus(tmp_path, {"node": f"127.0.0.1:{node.http_port}"})
    queries = [(title, ref, substitute(expr, ORIGINAL_VARIABLES)) for title, ref, expr in ORIGINAL_DASHBOARD_QUERIES]
    assert len(queries) == 46
    try:
        wait_until(lambda: prom.all_up({"node"}), START_S,
                   lambda: f"Prometheus to scrape the node (up == 1): {prom.log.read_text()[-2000:]}",
                   every=0.2, ignore=httpx.HTTPError)
        start = time.time()
        drive_node(node)  # saves evicted to SSD, an L1 hit, an SSD promotion, a miss
        drive_engine(node, failed_loads=1)  # a connector's save and loads: the copy times
        empty: list[str] = []

        def drawn_but_absent_here() -> bool:
            nonlocal empty
            # An RPC between every two scrapes: a rate over the RPC histograms needs two samples
            # that differ, and a fast drive can fall inside one scrape interval (on a busy host
            # the RPC latency quantiles stayed NaN: every observation in the series' first sample).
            node.stats()
            empty = [expr for _, _, expr in queries if not prom.drawn(expr, start)]
            return set(empty) <= ABSENT_HERE

        try:  # two scrapes after the traffic are enough; bounded: what stays empty fails
            wait_until(drawn_but_absent_here, 30, "the original's panels to show data", every=1.0)
        except AssertionError:
            pass
        shown = len(queries) - len(empty)
        named = "\n  ".join(f"{t} [{r}]: {e}" for t, r, e in queries if e in empty)
        print(f"the original's dashboard: {shown} of {len(queries)} queries show data; empty:\n  {named}")
        assert shown >= ORIGINAL_MIN_WITH_DATA, f"{shown} of {len(queries)} show data; empty:\n  {named}"
        assert set(empty) <= ABSENT_HERE, f"empty, though their series are exported here:\n  {named}"
    finally:
        prom.stop()
