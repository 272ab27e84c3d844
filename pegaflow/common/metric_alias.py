"""The Rust original's metric names, derived at scrape time from PegaFlow's own series.

The original (``novitalabs/pegaflow``, its ``docs/metrics.md``) exports ``pegaflow_pool_used_bytes``,
``pegaflow_cache_tier_block_requests_total{tier}``, ``pegaflow_rpc_duration_seconds{method,status}``
and so on; its users' dashboards and alerts query those names. Each event here is counted
once, under PegaFlow's name; an :class:`Alias` re-reads that series when Prometheus scrapes
and exposes it again under the original's name and labels (relabelled and, where several
of ours make one of the original's, summed). Nothing is recorded twice, so the two names
cannot disagree. The mapping table is in docs/metrics.md ("The original's names").
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

Kind = Literal["counter", "gauge", "histogram"]
# Source labels -> the original's label values (``None``: the sample is left out).
Relabel = Callable[[Mapping[str, str]], "dict[str, str] | None"]

# How the original labels an RPC's status: "ok", else tonic's ``Code`` as text (its Display).
TONIC_STATUS = {
    "OK": "ok",
    "CANCELLED": "The operation was cancelled",
    "UNKNOWN": "Unknown error",
    "INVALID_ARGUMENT": "Client specified an invalid argument",
    "DEADLINE_EXCEEDED": "Deadline expired before operation could complete",
    "NOT_FOUND": "Some requested entity was not found",
    "ALREADY_EXISTS": "Some entity that we attempted to create already exists",
    "PERMISSION_DENIED": "The caller does not have permission to execute the specified operation",
    "RESOURCE_EXHAUSTED": "Some resource has been exhausted",
    "FAILED_PRECONDITION": "The system is not in a state required for the operation's execution",
    "ABORTED": "The operation was aborted",
    "OUT_OF_RANGE": "Operation was attempted past the valid range",
    "UNIMPLEMENTED": "Operation is not implemented or not supported",
    "INTERNAL": "Internal error",
    "UNAVAILABLE": "The service is currently unavailable",
    "DATA_LOSS": "Unrecoverable data loss or corruption",
    "UNAUTHENTICATED": "The request does not have valid authentication credentials",
}

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


@functools.lru_cache(maxsize=256)
def snake(method: str) -> str:
    """``QueryPrefix`` -> ``query_prefix`` (the original labels methods in snake case)."""
    return _CAMEL.sub("_", method).lower()


def rpc_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """Our ``{method, status[, transport]}`` as the original's ``{method, status}``."""
    status = labels.get("status", "OK")
    return {"method": snake(labels.get("method", "")), "status": TONIC_STATUS.get(status, status)}


def drop_all(_: Mapping[str, str]) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Alias:
    """One of the original's series: ``name`` (a counter's without the ``_total`` its exporter
    adds: ``x_total`` is served as ``x_total_total``, as the original serves it), read from our
    ``sources`` (metric family names, of the same kind), relabelled by ``relabel`` onto
    ``labels`` and summed. ``fixed``: label sets always exported (0 until counted). An
    unlabelled one is 0 while its sources are registered and have counted nothing, and
    absent when none is registered (no SSD tier, no remote reads, no publisher)."""

    name: str
    kind: Kind
    doc: str
    sources: tuple[str, ...]
    labels: tuple[str, ...] = ()
    relabel: Relabel = drop_all
    fixed: tuple[tuple[str, ...], ...] = ()
    from_count: bool = False  # a counter read from histograms' ``_count`` (calls from latencies)
    # A histogram's upper bounds to export (and +Inf); empty: all of the source's. The
    # original's buckets, read from a source of ours that has them and finer ones too.
    buckets: frozenset[float] = frozenset()


@dataclass(frozen=True)
class ValueAlias:
    """One of the original's gauges (or counters) read from live state: ``values()`` gives
    ``(label values, value)`` pairs."""

    name: str
    kind: Literal["counter", "gauge"]
    doc: str
    values: Callable[[], Iterable[tuple[tuple[str, ...], float]]]
    labels: tuple[str, ...] = field(default=())


def _suffixes(kind: Kind) -> tuple[str, ...]:
    return {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}[kind]


class _Unseen(enum.Enum):
    """A sentinel an ``is`` check narrows (``object()`` is not narrowed by mypy)."""

    UNSEEN = 0


_UNSEEN: Final = _Unseen.UNSEEN


def _le_key(le: str) -> float:
    return math.inf if le == "+Inf" else float(le)


class OriginalNames(Collector):
    """Exposes ``aliases`` on ``registry`` (register it there: ``OriginalNames(reg, aliases)``).

    A scrape reads every source once (one restricted collect for all aliases) and relabels
    each label set once. Measured on a node-like registry (28 RPC histogram children, SSD,
    p2p and publisher series), each version in its own process: about 4 ms per collect
    either way (3.8-4.4 ms against 4.1-4.2 ms reading per alias; loaded 2-core host), so
    no measurable gain; most of the cost is per-sample work on the RPC histogram."""

    def describe(self) -> list[Metric]:
        return [self._family(a.name, a.kind, a.doc, a.labels) for a in self.aliases]

    @staticmethod
    def _family(
        name: str, kind: Kind, doc: str, labels: tuple[str, ...]
    ) -> CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily:
        if kind == "histogram":
            return HistogramMetricFamily(name, doc, labels=labels)
        return OriginalNames._scalar(name, kind, doc, labels)

    @staticmethod
    def _scalar(
        name: str, kind: Literal["counter", "gauge"], doc: str, labels: tuple[str, ...]
    ) -> CounterMetricFamily | GaugeMetricFamily:
        if kind == "counter":
            fam = CounterMetricFamily(name, doc, labels=labels)
            # prometheus_client drops a name's own ``_total``; the original's exporter keeps it
            # and adds one (its instrument ``x_total`` is served as ``x_total_total``): so does this.
            fam.name = name
            return fam
        return GaugeMetricFamily(name, doc, labels=labels)

    def __init__(self, registry: CollectorRegistry, aliases: Iterable[Alias | ValueAlias]) -> None:
        self.registry = registry
        self.aliases = list(aliases)
        # Every sample name any alias reads, and each alias's own (computed once).
        self._names = {id(a): frozenset(src + s for src in a.sources
                                        for s in (("_count",) if a.from_count else _suffixes(a.kind)))
                       for a in self.aliases if isinstance(a, Alias)}
        self._all = frozenset().union(*self._names.values()) if self._names else frozenset()
        registry.register(self)

    def _read_sources(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Every source sample, read once per scrape: a view of the registry restricted to
        the sources' names calls only their collectors (never this one)."""
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for metric in self.registry.restricted_registry(self._all).collect():
            for s in metric.samples:
                if s.name in self._all:
                    out.setdefault(s.name, []).append((s.labels, s.value))
        return out

    def _samples(self, alias: Alias, read: Mapping[str, list[tuple[dict[str, str], float]]],
                 known: Mapping[str, object]) -> Iterable[tuple[str, dict[str, str], float]]:
        names = self._names[id(alias)]
        # A source not registered (no SSD tier, no remote reads) yields nothing.
        if any(n in known for n in names):
            yield "", {}, 0.0  # the source is registered (it may have no sample yet)
        for name in names:
            for labels, value in read.get(name, ()):
                yield name, labels, value

    def collect(self) -> Iterable[Metric]:
        read = self._read_sources()
        known = self.registry._names_to_collectors  # noqa: SLF001 - is a source registered at all?
        for a in self.aliases:
            if isinstance(a, ValueAlias):
                scalar = self._scalar(a.name, a.kind, a.doc, a.labels)
                for values, v in a.values():
                    scalar.add_metric(list(values), v)
                yield scalar
                continue
            fam = self._family(a.name, a.kind, a.doc, a.labels)
            sums: dict[tuple[str, ...], float] = {key: 0.0 for key in a.fixed}
            buckets: dict[tuple[str, ...], dict[str, float]] = {}
            hsum: dict[tuple[str, ...], float] = {}
            present = False
            keys: dict[tuple[tuple[str, str], ...], tuple[str, ...] | None] = {}
            for sample, labels, value in self._samples(a, read, known):
                if not sample:
                    present = True
                    continue
                le = labels.get("le")
                base = tuple(kv for kv in labels.items() if kv[0] != "le")
                key = keys.get(base, _UNSEEN)
                if key is _UNSEEN:  # relabel each label set once (a histogram's buckets share it)
                    out = a.relabel(dict(base))
                    key = keys[base] = None if out is None else tuple(out.get(n, "") for n in a.labels)
                if key is None:
                    continue
                if a.kind != "histogram":
                    sums[key] = sums.get(key, 0.0) + value
                elif sample.endswith("_bucket") and le is not None:
                    if a.buckets and le != "+Inf" and float(le) not in a.buckets:
                        continue  # cumulative counts: dropping a bound leaves the others exact
                    b = buckets.setdefault(key, {})
                    b[le] = b.get(le, 0.0) + value
                elif sample.endswith("_sum"):
                    hsum[key] = hsum.get(key, 0.0) + value
            if isinstance(fam, HistogramMetricFamily):  # a.kind == "histogram"
                for key, b in buckets.items():
                    fam.add_metric(list(key), sorted(b.items(), key=lambda kv: _le_key(kv[0])), hsum.get(key, 0.0))
            else:
                if present and not a.labels and not sums:
                    sums[()] = 0.0  # registered, nothing counted yet: 0, as our own series show
                for key, v in sums.items():
                    fam.add_metric(list(key), v)
            yield fam
