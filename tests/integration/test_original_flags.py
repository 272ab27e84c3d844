"""Both daemons started with every flag of the original's (tests/original_flags.py), at once.

A production command line of the Rust original's 0.25.1 release (which holds every flag of
0.23.12) must start PegaFlow unchanged: the node (``pegaflow-server``, 34 flags) and the
metaserver (``pegaflow-metaserver``, 9 flags) start,
serve (the node: Health, a save and a load over the gRPC API, /metrics, OTLP exports at the
given period; the metaserver: the node in ListNodes, /metrics on its HTTP address), log each
flag that has no effect here once, and exit 0 on SIGTERM. The RDMA devices of ``--nics`` are
the fake verbs layer at the hardware edge (tests/fakes/pyverbs), as in test_quickstart.py.
``--use-hugepages`` needs huge pages reserved: where the host has none, the complete line
must fail with the pool's one-line reason, and the node then starts without that one flag.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import urllib.request
from pathlib import Path

import grpc
import pytest

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.config.options import META, NODE, options_for
from pegaflow.node.pool import _hugepages_free
from tests.harness.ports import free_port
from tests.harness.procs import log_events
from tests.integration.redis_fixtures import redis_server  # noqa: F401
from tests.integration.test_metrics_export import GrpcReceiver
from tests.integration.test_quickstart import (  # noqa: F401
    FAKES,
    ROOT,
    Proc,
    client,
    console,
    metaserver_serves,
    node_serves,
    procs,
    wait_until,
)
from tests.original_flags import ORIGINAL_METASERVER_FLAGS_0251, ORIGINAL_SERVER_FLAGS_0251, argv

pytestmark = pytest.mark.integration


def without_effect_logged(log: str) -> collections.Counter[str]:
    """How often each flag was logged as having no effect (JSON log lines)."""
    return collections.Counter(rec["flag"] for rec in log_events(log, "option_without_effect"))


def no_effect_flags(command: str) -> set[str]:
    return {f"--{o.name}" for o in options_for(command) if o.no_effect}


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        return r.read().decode()


def stop_cleanly(p: Proc, last_line: str) -> None:
    p.p.send_signal(signal.SIGTERM)
    assert p.p.wait(timeout=30) == 0, p.log()[-3000:]
    assert last_line in p.log(), p.log()[-3000:]


def test_both_daemons_start_and_serve_with_the_originals_complete_flag_lists(
    tmp_path: Path, procs: list[Proc], redis_server  # noqa: F811
):
    ports = {k: str(free_port()) for k in ("node_port", "node_http_port", "meta_port", "meta_http_port")}
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    receiver = GrpcReceiver()  # the original exports over OTLP/gRPC
    values = {**ports, "otel_port": str(receiver.port), "ssd": str(ssd)}
    json_logs = {"PEGAFLOW_LOG_FORMAT": "json"}

    m = Proc([console("pegaflow-metaserver"), *argv(ORIGINAL_METASERVER_FLAGS_0251, **values)], tmp_path / "meta.log",
             {**json_logs, "PEGAFLOW_REDIS_URL": redis_server.url})
    procs.append(m)
    meta_addr = f"127.0.0.1:{ports['meta_port']}"
    wait_until(lambda: metaserver_serves(meta_addr, m), 30, "pegaflow-metaserver with the original's flags")
    channel = grpc.insecure_channel(meta_addr)
    stub = meta_pb2_grpc.MetaServiceStub(channel)

    node_env = {**json_logs, "PEGAFLOW_NODE_ID": "orig-flags", "PEGAFLOW_FAKE_RDMA_DEVICES": "mlx5_0,mlx5_1",
                "PYTHONPATH": os.pathsep.join([str(FAKES), str(ROOT)])}
    full = [console("pegaflow-server"), *argv(ORIGINAL_SERVER_FLAGS_0251, **values)]
    free, size = _hugepages_free()
    if free * size < (64 << 20):
        # The original refuses too: its pinned pool needs the huge pages reserved.
        tried = Proc(full, tmp_path / "node-hugepages.log", node_env)
        assert tried.p.wait(timeout=60) == 1
        lines = tried.log().strip().splitlines()
        assert "--use-hugepages needs" in lines[-1] and "Traceback" not in tried.log(), tried.log()[-3000:]
        full = [console("pegaflow-server"), *argv(ORIGINAL_SERVER_FLAGS_0251, skip=("--use-hugepages",), **values)]
    n = Proc(full, tmp_path / "node.log", node_env)
    procs.append(n)
    addr = f"127.0.0.1:{ports['node_port']}"
    wait_until(lambda: node_serves(addr, n), 60, "pegaflow-server with the original's flags")

    # It serves: blocks saved and loaded through the gRPC API, with the SSD tier and RDMA on.
    assert client("save", addr, "orig", 4)["committed"] == 4
    loaded = client("load", addr, "orig", 4)
    assert loaded["hit"] == 4 and loaded["identical"], loaded
    log = n.log()
    assert "ssd_tier_ready" in log and '"transport": "rdma"' in log, log[-3000:]
    # --enable-prometheus: /metrics on --http-addr; --metrics-otel-endpoint at --metrics-period-secs 1
    # (the SDK's own period is 60 s, so two exports within 15 s are the flag's).
    assert "pegaflow_node_pool_capacity_bytes" in metrics_text(int(ports["node_http_port"]))
    wait_until(lambda: len(receiver.requests) >= 2, 15, "two OTLP exports a second apart")
    assert "pegaflow-node" in receiver.services()

    # The metaserver lists the node (found through --metaserver-addr) and serves /metrics.
    def listed() -> bool:
        return any(x.address == addr and x.alive for x in stub.ListNodes(meta_pb2.ListNodesRequest(), timeout=2).nodes)

    wait_until(listed, 30, "the node in the metaserver's ListNodes")
    assert "pegaflow_meta" in metrics_text(int(ports["meta_http_port"]))

    # Each flag without effect here is logged once, and only those.
    for p, command in ((n, NODE), (m, META)):
        logged = without_effect_logged(p.log())
        assert set(logged) == no_effect_flags(command) and all(v == 1 for v in logged.values()), (command, logged)

    channel.close()
    stop_cleanly(n, "node_stopped")
    stop_cleanly(m, "metaserver stopped")
    receiver.close()


def test_prometheus_off_leaves_metrics_empty_and_health_answering(tmp_path: Path, procs: list[Proc]):  # noqa: F811
    # The original's --enable-prometheus is a switch that is on by default (clap SetTrue), so
    # only the environment can turn it off.
    port, http = free_port(), free_port()
    n = Proc([console("pegaflow-server"), "--addr", f"127.0.0.1:{port}", "--pool-size", "64mb",
              "--http-addr", f"127.0.0.1:{http}"], tmp_path / "node.log", {"PEGAFLOW_ENABLE_PROMETHEUS": "false"})
    procs.append(n)
    wait_until(lambda: node_serves(f"127.0.0.1:{port}", n), 60, "pegaflow-server")
    assert "pegaflow_" not in metrics_text(http)
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5) as r:
        assert json.loads(r.read())["ok"] is True
    stop_cleanly(n, "node_stopped")


def test_qps_per_peer_is_logged_without_effect_on_a_tcp_node(tmp_path: Path, procs: list[Proc]):  # noqa: F811
    # --qps-per-peer only shapes RDMA pulls (--nics with --metaserver-addr); with the full
    # flag list above it is used (not logged), without --nics it is said to do nothing.
    port = free_port()
    n = Proc([console("pegaflow-server"), "--addr", f"127.0.0.1:{port}", "--pool-size", "64mb", "--http-addr", "off",
              "--qps-per-peer", "4"], tmp_path / "node.log", {"PEGAFLOW_LOG_FORMAT": "json"})
    procs.append(n)
    wait_until(lambda: node_serves(f"127.0.0.1:{port}", n), 60, "pegaflow-server")
    assert without_effect_logged(n.log())["--qps-per-peer"] == 1
    stop_cleanly(n, "node_stopped")
