"""docs/metrics.md documents exactly the metrics the node, the metaserver, the router and the engine-side copier export, and the
Grafana dashboard only queries documented metrics.

Nothing heavy starts: the registries are instantiated in-process (the node's NodeMetrics
with its SSD tier's, remote reads' and event publisher's series, the metaserver's MetaMetrics
and its cluster-ceiling collector) and their families are compared with the doc's tables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "docs" / "grafana" / "pegaflow.json"

_ROW = re.compile(r"^\|\s*`(pegaflow_[a-z0-9_]+)`\s*\|\s*([a-z]+)\s*\|\s*([^|]*)\|")


def documented() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) from the tables of docs/metrics.md."""
    out: dict[str, tuple[str, set[str]]] = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            name, kind, labels = m.groups()
            assert name not in out, f"{name} is documented twice"
            out[name] = (kind, set(re.findall(r"`([a-z_]+)`", labels)))
    return out


def exported_name(fam_name: str, kind: str) -> str:
    return fam_name + "_total" if kind == "counter" else fam_name


def node_families() -> dict[str, tuple[str, set[str]]]:
    from pegaflow.core.block_index import BlockIndex
    from pegaflow.node.backup import BackupMetrics
    from pegaflow.node.metrics import ClassMetrics, NodeMetrics
    from pegaflow.node.publishing import PublisherMetrics
    from pegaflow.node.quota_metrics import register as register_quota_metrics
    from pegaflow.node.residence import Residence
    from pegaflow.node.tiers.remote.metrics import PeerMetrics
    from pegaflow.node.tiers.ssd.metrics import SsdMetrics
    from pegaflow.policy.quota import Quotas

    m = NodeMetrics(CollectorRegistry())
    SsdMetrics(m.registry)
    PeerMetrics(m.registry)
    PublisherMetrics(m.registry)
    quotas = Quotas.parse(["doc=0.5"])  # --namespace-quota's collector (registered only with quotas)
    register_quota_metrics(m.registry, BlockIndex(1 << 20, quotas=quotas), quotas)
    Residence(m.registry)
    ClassMetrics(m.registry, lambda: (0, 0, {}))
    BackupMetrics(m.registry)
    return families(m.registry)


def meta_families() -> dict[str, tuple[str, set[str]]]:
    from pegaflow.cluster.sketches import ClusterCeilingCollector
    from pegaflow.meta.backup import BackupMetrics
    from pegaflow.meta.metrics import MetaMetrics

    reg = CollectorRegistry()
    reg.register(ClusterCeilingCollector(None, (900.0,)))  # type: ignore[arg-type]  (describe only)
    out = families(reg, describe=True)
    out.update(families(MetaMetrics(CollectorRegistry()).registry))
    backup_reg = CollectorRegistry()
    backup = BackupMetrics(backup_reg)
    for labelled in (backup.dispatched_blocks, backup.dispatched_bytes, backup.pair):
        labelled.labels("p", "d")
    out.update(families(backup_reg))
    return out


def client_families() -> dict[str, tuple[str, set[str]]]:
    from pegaflow.client.kernels import CopyMetrics

    m = CopyMetrics(CollectorRegistry())
    m.kernel.labels("save", "memcpy").set(1)
    m.calibration_gbps.labels("save", "memcpy").set(1.0)
    out = families(m.registry)
    from pegaflow.client.cuda import PinMetrics

    out.update(families(PinMetrics(CollectorRegistry()).registry))
    return out


def router_families() -> dict[str, tuple[str, set[str]]]:
    from pegaflow.router.app import RouterMetrics

    return families(RouterMetrics(CollectorRegistry()).registry)


def families(reg: CollectorRegistry, describe: bool = False) -> dict[str, tuple[str, set[str]]]:
    """Our families (the original's names, derived from ours, have their own table: see
    tests/integration/test_original_metrics.py)."""
    from tests.original_metrics import ORIGINAL_NAMES

    out: dict[str, tuple[str, set[str]]] = {}
    collectors = list(reg._collector_to_names) if describe else [reg]  # noqa: SLF001
    for c in collectors:
        for fam in c.describe() if describe else c.collect():  # type: ignore[union-attr]
            labels: set[str] = set()
            for s in fam.samples:
                labels |= set(s.labels) - {"le", "quantile"}
            labels |= set(getattr(fam, "_labelnames", ()) or ())
            name = exported_name(fam.name, fam.type)
            if name not in ORIGINAL_NAMES:
                out[name] = (fam.type, labels)
    return out


def test_every_exported_metric_is_documented_with_its_type() -> None:
    doc = documented()
    exported = {**node_families(), **meta_families(), **client_families(), **router_families()}
    assert len(exported) > 50  # the registries really were built
    missing = sorted(set(exported) - set(doc))
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
    wrong = {n: (doc[n][0], t) for n, (t, _) in exported.items() if doc[n][0] != t}
    assert not wrong, f"documented type differs from the exported one (doc, code): {wrong}"


def test_documented_labels_match_the_labels_seen() -> None:
    doc = documented()
    exported = {**node_families(), **meta_families(), **client_families(), **router_families()}
    # Labels are only visible on children that exist; check those we can see.
    bad = {n: (doc[n][1], labels) for n, (_, labels) in exported.items() if labels and not labels <= doc[n][1]}
    assert not bad, f"labels exported but not documented (doc, code): {bad}"


def test_no_documented_metric_is_stale() -> None:
    exported = {**node_families(), **meta_families(), **client_families(), **router_families()}
    stale = sorted(set(documented()) - set(exported))
    assert not stale, f"docs/metrics.md lists metrics nobody exports: {stale}"


def test_names_follow_the_scheme() -> None:
    for name, (kind, _) in documented().items():
        assert name.startswith(("pegaflow_node_", "pegaflow_meta_", "pegaflow_client_", "pegaflow_router_")), name
        assert name.endswith("_total") == (kind == "counter"), name


def dashboard_metrics(dash: dict) -> set[str]:
    exprs: list[str] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("expr", "query") and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(dash)
    assert exprs, "the dashboard has no queries"
    return {m for e in exprs for m in re.findall(r"\bpegaflow_[a-z0-9_]+", e)}


def base_name(series: str, doc: dict[str, tuple[str, set[str]]]) -> str:
    """A histogram's ``_bucket``/``_count``/``_sum`` series belongs to its documented family."""
    if series in doc:
        return series
    for suffix in ("_bucket", "_count", "_sum"):
        if series.endswith(suffix) and doc.get(series[: -len(suffix)], ("",))[0] == "histogram":
            return series[: -len(suffix)]
    return series


def test_dashboard_queries_only_documented_metrics() -> None:
    if not DASHBOARD.exists():
        pytest.fail(f"{DASHBOARD} is missing")
    dash = json.loads(DASHBOARD.read_text())
    doc = documented()
    used = dashboard_metrics(dash)
    unknown = sorted(s for s in used if base_name(s, doc) not in doc)
    assert not unknown, f"dashboard queries metrics not in docs/metrics.md: {unknown}"
    # The dashboard's purpose: the measured hit rate against the ceiling, node and cluster.
    for needed in ("pegaflow_node_ceiling_hit_ratio", "pegaflow_node_measured_hit_ratio",
                   "pegaflow_meta_cluster_ceiling_hit_ratio", "pegaflow_meta_cluster_measured_hit_ratio",
                   "pegaflow_node_request_blocks_total", "pegaflow_node_evictions_total",
                   "pegaflow_node_admission_rejections_total", "pegaflow_node_pool_used_bytes",
                   "pegaflow_node_rpc_duration_seconds_bucket"):
        assert needed in used, f"dashboard does not show {needed}"


def test_dashboard_check_catches_an_undocumented_metric() -> None:
    """The check above can fail: a query of an unknown series is reported."""
    doc = documented()
    used = dashboard_metrics({"panels": [{"targets": [{"expr": "rate(pegaflow_node_bogus_total[5m])"}]}]})
    assert [s for s in used if base_name(s, doc) not in doc] == ["pegaflow_node_bogus_total"]


def test_connector_metrics_table_lists_exactly_the_workers_counters() -> None:
    from pegaflow.connector.connector import _PROM_COUNTERS

    doc = (ROOT / "docs" / "connector.md").read_text()
    listed = set(re.findall(r"^\| `(vllm:pegaflow_[a-z_]+)` \|", doc, flags=re.M))
    assert listed == {name for name, _ in _PROM_COUNTERS.values()}


def test_the_otlp_section_gives_the_export_period_the_daemons_use() -> None:
    """The daemons pass --metrics-period-secs to the exporter (pegaflow/node/daemon.py,
    pegaflow/meta/daemon.py), so the SDK's OTEL_METRIC_EXPORT_INTERVAL is never read."""
    from pegaflow.config.options import NODE, default_of, options_for

    doc = (ROOT / "docs" / "metrics.md").read_text()
    section = doc[doc.index("## OTLP export"):doc.index("## Dashboard")]
    period = next(o for o in options_for(NODE) if o.name == "metrics-period-secs")
    assert "`--metrics-period-secs`" in section and f"default {default_of(period)}" in section
    assert "OTEL_METRIC_EXPORT_INTERVAL` ms" not in section
