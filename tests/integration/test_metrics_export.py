"""`--metrics-otel-endpoint`: a real node pushes its Prometheus metrics over OTLP, gRPC (the
original's, by default) or HTTP, to a loopback receiver in the test (names, labels and values
as on /metrics); without the otel extra the flag is a one-line start-up error."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import xxhash

from pegaflow.client import PegaClient
from pegaflow.common.otel import GRPC, HTTP, OtelUnavailable, grpc_target, metrics_url, protocol
from tests.harness.meta import MetaServer
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server

otlp = pytest.importorskip(
    "opentelemetry.proto.collector.metrics.v1.metrics_service_pb2",
    reason="the otel extra (opentelemetry-exporter-otlp-proto-http) is not installed",
)


class Receiver:
    """A loopback OTLP/HTTP metrics endpoint that keeps every decoded export request."""

    def __init__(self) -> None:
        self.requests: list[object] = []
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                enc = self.headers.get("Content-Encoding", "")
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                req = otlp.ExportMetricsServiceRequest()
                req.ParseFromString(body)
                outer.requests.append(req)
                outer.paths.append(self.path)
                out = otlp.ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def points(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Latest value of every (metric name, attributes) received, and the resources seen."""
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for req in self.requests:
            for rm in req.resource_metrics:  # type: ignore[attr-defined]
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        data = m.sum if m.HasField("sum") else m.gauge
                        for p in data.data_points:
                            attrs = tuple(sorted((a.key, a.value.string_value) for a in p.attributes))
                            v = p.as_double if p.HasField("as_double") else p.as_int
                            out[(m.name, attrs)] = v
        return out

    def services(self) -> set[str]:
        return {a.value.string_value for req in self.requests for rm in req.resource_metrics  # type: ignore[attr-defined]
                for a in rm.resource.attributes if a.key == "service.name"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(Receiver):
    """A loopback OTLP/gRPC metrics endpoint (the original's export) keeping every request."""

    def __init__(self) -> None:  # noqa: D107 - no HTTP server: Receiver's decoding only
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

        self.requests = []
        self.paths = []
        outer = self

        class Sink(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: object, context: object) -> object:  # noqa: N802 (gRPC API)
                outer.requests.append(request)
                return otlp.ExportMetricsServiceResponse()

        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Sink(), self.grpc)
        self.port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()

    def close(self) -> None:
        self.grpc.stop(None)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def grpc_receiver() -> Iterator[GrpcReceiver]:
    r = GrpcReceiver()
    yield r
    r.close()


def test_node_pushes_its_metrics_over_grpc_as_the_original_does(node_factory, grpc_receiver: GrpcReceiver) -> None:
    """The original's --metrics-otel-endpoint is OTLP/gRPC (``http://127.0.0.1:4317``): ours
    spoke only OTLP/HTTP, so the original's endpoint received nothing."""
    node = node_factory(extra=["--metrics-otel-endpoint", f"http://127.0.0.1:{grpc_receiver.port}",
                               "--metrics-period-secs", "1"])
    with PegaClient(node.addr) as c:
        c.register({"m": 8192})
        res = c.reserve("m", [xxhash.xxh3_128_digest(b"otel-grpc")])
        c.commit(res.reservation_id)
    pts = wait_until(lambda: (p := grpc_receiver.points()).get(("pegaflow_node_resident_blocks", ())) == 1 and p,
                     30, "the node's metrics pushed over gRPC", every=0.2)
    assert pts[("pegaflow_node_pool_capacity_bytes", ())] == 64 << 20
    assert grpc_receiver.services() == {"pegaflow-node"}


def test_node_pushes_its_metrics_to_an_otlp_http_receiver(node_factory, receiver: Receiver) -> None:
    # OTLP/HTTP at a port that is not 4318, as OpenTelemetry's own variable asks.
    node = node_factory(extra=["--metrics-otel-endpoint", f"http://127.0.0.1:{receiver.port}"],
                        env={"OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": HTTP})
    hs = [xxhash.xxh3_128_digest(f"otel:{i}".encode()) for i in range(5)]
    with PegaClient(node.addr) as c:
        c.register({"m": 8192})
        res = c.reserve("m", hs[:3])
        c.commit(res.reservation_id)
        q = c.query(["m"], hs, req_id="r1", lease=False)
        assert q.hit_blocks == 3

    want_hits = ("pegaflow_node_hit_blocks_total", (("tier", "l1"),))
    want_miss = ("pegaflow_node_miss_blocks_total", ())

    def counted() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        pts = receiver.points()
        return pts if pts.get(want_hits) == 3 and pts.get(want_miss) == 2 else None

    pts = wait_until(counted, 30, lambda: "3 hits and 2 misses pushed; hit series: "
                     f"{sorted(k for k in receiver.points() if 'hit' in k[0])}", every=0.2)
    assert pts[("pegaflow_node_pool_capacity_bytes", ())] == 64 << 20
    assert pts[("pegaflow_node_resident_blocks", ())] == 3
    # Histograms travel as cumulative _count/_sum/_bucket series with the Prometheus labels.
    query_ok = (("method", "Query"), ("status", "OK"), ("transport", "local"))  # PegaClient's fast path
    assert pts[("pegaflow_node_rpc_duration_seconds_count", query_ok)] >= 1
    assert any(name == "pegaflow_node_rpc_duration_seconds_bucket" and ("le", "+Inf") in attrs
               for name, attrs in pts)
    assert receiver.paths and all(p == "/v1/metrics" for p in receiver.paths)
    assert receiver.services() == {"pegaflow-node"}


def test_metaserver_pushes_its_metrics_and_the_cluster_view(redis_server: RedisServer, receiver: Receiver,
                                                             tmp_path: Path) -> None:
    meta = MetaServer(redis_server.url, tmp_path / "meta.log",
                      extra=["--sweep-interval", "0", "--metrics-otel-endpoint",
                             f"http://127.0.0.1:{receiver.port}/v1/metrics"],  # a path: OTLP/HTTP
                      env={"OTEL_METRIC_EXPORT_INTERVAL": "300"}).start()
    try:

        def pushed() -> bool:
            assert meta.proc is not None and meta.proc.poll() is None, meta.log()[-2000:]
            return ("pegaflow_meta_cluster_sketch_nodes", ()) in receiver.points()

        wait_until(pushed, 30, "the metaserver's cluster view pushed", every=0.2)
        pts = receiver.points()
        assert pts.get(("pegaflow_meta_cluster_sketch_nodes", ())) == 0, meta.log()[-2000:]
        assert ("pegaflow_meta_streams_owned", ()) in pts
        assert receiver.services() == {"pegaflow-meta"}
    finally:
        meta.stop()


def test_the_protocol_is_grpc_unless_the_endpoint_or_opentelemetrys_variable_says_http() -> None:
    assert protocol("http://127.0.0.1:4317", {}) == GRPC  # the original's example
    assert protocol("collector:9000", {}) == GRPC
    assert protocol("https://otel.example", {}) == GRPC
    assert protocol("http://127.0.0.1:4318", {}) == HTTP  # OTLP/HTTP's port
    assert protocol("http://c:9000/v1/metrics", {}) == HTTP  # a path
    assert protocol("http://c:4317", {"OTEL_EXPORTER_OTLP_PROTOCOL": HTTP}) == HTTP
    assert protocol("http://c:4318", {"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": GRPC,
                                      "OTEL_EXPORTER_OTLP_PROTOCOL": HTTP}) == GRPC
    with pytest.raises(OtelUnavailable, match="http/json"):
        protocol("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert grpc_target("http://127.0.0.1:4317/") == ("127.0.0.1:4317", True)
    assert grpc_target("https://otel.example:443") == ("otel.example:443", False)
    assert grpc_target("collector:4317") == ("collector:4317", True)


def test_endpoint_url_gets_the_otlp_metrics_path() -> None:
    assert metrics_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/metrics"
    assert metrics_url("127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/metrics"
    assert metrics_url("https://otel.example:443/custom/path") == "https://otel.example:443/custom/path"


def test_without_the_otel_extra_the_flag_is_a_one_line_error(tmp_path: Path) -> None:
    # Shadow the opentelemetry package with one that fails to import, as if not installed.
    fake = tmp_path / "shadow" / "opentelemetry"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named opentelemetry (test shadow)')\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "pegaflow.node.cli", "--addr", "127.0.0.1:0", "--pool-size", "4mb",
         "--http-addr", "off", "--metrics-otel-endpoint", "http://127.0.0.1:9"],
        env={"PYTHONPATH": f"{fake.parent}:{root}", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("pegaflow-node: error: --metrics-otel-endpoint needs the otel extra")
