"""Optional OTLP export of a Prometheus registry (``--metrics-otel-endpoint``).

The Prometheus registry stays the one definition of every metric (``docs/metrics.md``);
this module only mirrors it: each metric family becomes OpenTelemetry *observable*
instruments whose callbacks read the registry, and a periodic reader pushes them to an
OTLP collector, over gRPC as the original does (``http://host:4317``), or over HTTP
(:func:`protocol`: an endpoint with a path or on port 4318, or the OpenTelemetry
variable ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` set to
``http/protobuf``). Names and labels are unchanged, so a dashboard works on either path:

- counter ``x`` → observable counter ``x_total`` (cumulative);
- gauge ``x`` → observable gauge ``x``;
- histogram / summary ``x`` → observable counters ``x_count``, ``x_sum`` and, for
  histograms, ``x_bucket`` with the ``le`` attribute (OpenTelemetry has no observable
  histogram, so the Prometheus buckets travel as cumulative counters).

Families registered after :func:`start_otel_export` are not exported: call it once the
process has created its metrics. The registry is collected at most once per export
(a cache shared by every callback of one cycle). The export interval is the SDK's
(``OTEL_METRIC_EXPORT_INTERVAL`` in ms, default 60 s) unless ``interval`` is given.

Needs the ``otel`` extra (``pip install 'pegaflow[otel]'``); without it
:func:`check_available` raises :class:`OtelUnavailable` with a one-line message.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

if TYPE_CHECKING:  # the otel extra, imported where an export starts
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter

CACHE_SECONDS = 0.5  # callbacks of one export cycle share one collect() of the registry


GRPC, HTTP = "grpc", "http/protobuf"  # OTLP's protocols, as OTEL_EXPORTER_OTLP_PROTOCOL names them
HTTP_PORT = 4318  # OTLP/HTTP's registered port (gRPC's is 4317)
EXPORT_TIMEOUT_S = 5.0  # one export's deadline: a stop waits at most about this on a dead collector


class OtelUnavailable(Exception):
    """The OpenTelemetry SDK or the exporter the endpoint needs is not installed, or the
    protocol asked for is not one we speak."""


def protocol(endpoint: str, env: Mapping[str, str] = os.environ) -> str:
    """:data:`GRPC` or :data:`HTTP` for ``endpoint``: the OpenTelemetry protocol variable when
    set; else HTTP for an endpoint with a path or on port 4318, gRPC otherwise (the
    original's export, e.g. ``http://127.0.0.1:4317``)."""
    asked = env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if asked:
        if asked not in (GRPC, HTTP):
            raise OtelUnavailable(f"--metrics-otel-endpoint: OTLP protocol {asked!r} is not {GRPC} or {HTTP}")
        return asked
    parts = urlsplit(endpoint.strip() if "://" in endpoint else "http://" + endpoint.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    return HTTP if parts.path not in ("", "/") or port == HTTP_PORT else GRPC


def check_available(endpoint: str = "") -> None:
    """Raise :class:`OtelUnavailable` (one line) unless the ``otel`` extra (the SDK and the
    exporter of ``endpoint``'s protocol) is installed."""
    try:
        if protocol(endpoint) == GRPC:
            import opentelemetry.exporter.otlp.proto.grpc.metric_exporter  # noqa: F401
        else:
            import opentelemetry.exporter.otlp.proto.http.metric_exporter  # noqa: F401
        import opentelemetry.sdk.metrics  # noqa: F401
    except ImportError as exc:
        raise OtelUnavailable(
            f"--metrics-otel-endpoint needs the otel extra (pip install 'pegaflow[otel]'): {exc}"
        ) from None


def grpc_target(endpoint: str) -> tuple[str, bool]:
    """(``host:port`` for the gRPC exporter, insecure): ``https://`` is TLS, anything else not."""
    e = endpoint.strip()
    scheme, sep, rest = e.partition("://")
    if not sep:
        scheme, rest = "http", e
    return rest.rstrip("/"), scheme != "https"


def metrics_url(endpoint: str) -> str:
    """The OTLP/HTTP metrics URL: ``http://host:4318`` gets ``/v1/metrics`` appended."""
    e = endpoint.strip()
    if "://" not in e:
        e = "http://" + e
    scheme, _, rest = e.partition("://")
    if "/" not in rest or rest.endswith("/"):
        e = e.rstrip("/") + "/v1/metrics"
    return e


class OtelExport:
    """A running export: a MeterProvider whose periodic reader pushes the mirrored registry."""

    def __init__(self, provider: MeterProvider) -> None:
        self.provider = provider

    def flush(self, timeout_ms: int = 10_000) -> bool:
        return bool(self.provider.force_flush(timeout_ms))

    def stop(self) -> None:
        """Push once more and stop the reader thread (bounded: a collector that does not
        answer costs one export's deadline)."""
        self.provider.shutdown(timeout_millis=2 * EXPORT_TIMEOUT_S * 1000)


class _Snapshot:
    """Registry samples keyed by sample name, re-collected when older than CACHE_SECONDS."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._lock = threading.Lock()
        self._at = -1e18
        self._samples: dict[str, list[tuple[dict[str, str], float]]] = {}

    def get(self, name: str) -> list[tuple[dict[str, str], float]]:
        with self._lock:
            if time.monotonic() - self._at > CACHE_SECONDS:
                out: dict[str, list[tuple[dict[str, str], float]]] = {}
                for fam in self.registry.collect():
                    for s in fam.samples:
                        out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
                self._samples = out
                self._at = time.monotonic()
            return self._samples.get(name, [])


def instruments(registry: CollectorRegistry) -> list[tuple[str, str, str]]:
    """``(kind, sample name, help)`` for every exported series; kind is ``counter`` or ``gauge``."""
    out: list[tuple[str, str, str]] = []
    for fam in registry.collect():
        if fam.type == "counter":
            out.append(("counter", fam.name + "_total", fam.documentation))
        elif fam.type == "gauge":
            out.append(("gauge", fam.name, fam.documentation))
        elif fam.type in ("histogram", "summary"):
            for suffix in ("_count", "_sum", *(("_bucket",) if fam.type == "histogram" else ())):
                out.append(("counter", fam.name + suffix, fam.documentation))
        else:  # info, stateset, unknown: exported as gauges of their samples
            out.append(("gauge", fam.name, fam.documentation))
    return out


def _exporter(endpoint: str) -> MetricExporter:
    if protocol(endpoint) == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        target, insecure = grpc_target(endpoint)
        return GrpcExporter(endpoint=target, insecure=insecure, timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

    return HttpExporter(endpoint=metrics_url(endpoint), timeout=EXPORT_TIMEOUT_S)


def start_otel_export(
    endpoint: str, registry: CollectorRegistry, service_name: str, interval: float | None = None
) -> OtelExport:
    """Mirror ``registry`` to the OTLP collector at ``endpoint``; returns the running export."""
    check_available(endpoint)
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(
        _exporter(endpoint),
        export_interval_millis=None if interval is None else interval * 1000,
        export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
    )
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": service_name}))
    meter = provider.get_meter("pegaflow")
    snap = _Snapshot(registry)

    def callback(name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, labels) for labels, v in snap.get(name)]

        return observe

    for kind, name, doc in instruments(registry):
        make = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
        make(name, callbacks=[callback(name)], description=doc)
    return OtelExport(provider)
