"""A small live stack for the metrics tests: redis-server, a `pegaflow-meta` with its HTTP
endpoint, and a node with an SSD tier publishing to that Redis; plus traffic that moves
the counters (saves that evict to SSD, an L1 hit, an SSD promotion, a miss, metaserver
lookups good and bad; and an engine's connector saving and loading through the node, which
reports its copy times) and a Prometheus text scraper."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from pegaflow._proto import meta_pb2, meta_pb2_grpc
from pegaflow.client import PegaClient
from tests.harness.meta import MetaServer
from tests.waiting import wait_until

NS = "metrics-model"
PAGE = 64 << 10
POOL = "1mb"  # 16 pages: the first of 24 saved blocks are evicted to SSD
SAVED = 24
WAIT_S = 20.0  # bound of every wait on a loaded 2-core machine


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


Samples = dict[str, list[tuple[dict[str, str], float]]]  # series name -> [(labels, value)]
Types = dict[str, str]  # exported family name (counters with _total) -> type


def scrape(port: int) -> tuple[Types, Samples]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    types: Types = {}
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name + "_total" if fam.type == "counter" else fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the series ``name`` whose labels include ``labels``."""
    return sum(v for lb, v in samples.get(name, []) if all(lb.get(k) == x for k, x in labels.items()))


def start_metaserver(tmp: Path, redis_url: str, extra: tuple[str, ...] = ()) -> MetaServer:
    """The stack's metaserver (tests/harness/meta.py): /metrics on, log in ``tmp``/meta.log."""
    return MetaServer(redis_url, tmp / "meta.log", http=True, extra=extra).start()


def node_args(tmp: Path, redis_url: str | None, node_id: str = "metrics-node") -> list[str]:
    """The stack's node: an SSD tier, publishing to ``redis_url`` (None: no Redis)."""
    publish = ["--redis-url", redis_url] if redis_url is not None else []
    return [*publish, "--node-id", node_id, "--ssd-cache-path", str(tmp / "ssd.cache"),
            "--ssd-cache-capacity", "16mb", "--ssd-queue-depth", "8"]


@dataclass
class Traffic:
    saved: list[bytes]
    l1_hits: int  # blocks a READY answer found in L1 (request "hit")
    ssd_blocks: int  # blocks of the request "ssd", promoted from SSD for it
    missed: int  # blocks of the request "miss"
    queries: int  # Query RPCs sent
    meta_ok: int  # good QueryPrefix calls
    meta_bad: int  # QueryPrefix calls answered INVALID_ARGUMENT


def drive(node, meta: MetaServer) -> Traffic:  # type: ignore[no-untyped-def]
    """Saves that overflow the 16-page pool into SSD, then three requests: an L1 hit, an SSD
    promotion and a miss; and metaserver lookups, good and bad."""
    t = drive_node(node)
    with grpc.insecure_channel(meta.addr) as ch:
        stub = meta_pb2_grpc.MetaServiceStub(ch)
        for _ in range(3):
            stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=NS, hashes=t.saved[-4:]), timeout=5)
        try:
            stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace="", hashes=t.saved[:1]), timeout=5)
            raise AssertionError("an empty namespace was accepted")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, exc
    return t


def drive_node(node) -> Traffic:  # type: ignore[no-untyped-def]
    """The node's part of :func:`drive` (no metaserver lookups)."""
    c = PegaClient(node.addr)
    try:
        c.register({NS: PAGE})
        hs = hashes("saved", SAVED)
        for i in range(0, SAVED, 4):
            if i:
                wait_until(lambda: node.metric("pegaflow_node_ssd_write_queue_blocks") == 0, WAIT_S,
                           "the SSD write queue to drain")
            part = hs[i:i + 4]
            r = c.reserve(NS, part)
            for h, off in zip(part, r.offsets, strict=True):
                if off >= 0:
                    page = np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(PAGE)
                    r.pool[off:off + PAGE] = torch.frombuffer(bytearray(page), dtype=torch.uint8)
            c.commit(r.reservation_id)
        wait_until(lambda: node.metric("pegaflow_node_ssd_blocks") >= SAVED, WAIT_S, "every block on SSD")
        queries = 0
        q = c.query([NS], hs[-4:], req_id="hit")
        queries += 1
        assert q.status == "READY" and q.hit_blocks == 4, q
        c.release(q.lease_id)

        def promoted():  # type: ignore[no-untyped-def]
            nonlocal queries
            queries += 1
            a = c.query([NS], hs[:4], req_id="ssd")
            return a if a.status == "READY" else None

        q = wait_until(promoted, WAIT_S, "the SSD promotion", every=0.01)
        assert q.hit_blocks == 4, q
        c.release(q.lease_id)
        q = c.query([NS], hashes("never-saved", 4), req_id="miss")
        queries += 1
        assert q.status == "READY" and q.hit_blocks == 0, q
    finally:
        c.close()
    return Traffic(hs, 4, 4, 4, queries, 3, 1)


@dataclass
class EngineTraffic:
    saves: int  # save batches the engine's worker copied (one per step that saved)
    loads: int  # load batches it copied
    load_failures: int  # load batches that failed (vLLM recomputes their blocks)


def drive_engine(node, failed_loads: int = 0) -> EngineTraffic:  # type: ignore[no-untyped-def]
    """An engine's connector (its real scheduler and worker sides, a stand-in for vLLM:
    tests/unit/connector_fakes.py) against the node: a prompt computed and saved, then the
    same prompt loaded by a second engine, then ``failed_loads`` times more with a copy that
    fails. The worker times its copies and the scheduler side sends them on the Commits and
    Releases it sends anyway: the node's save and load durations and load failures."""
    from pegaflow.connector.link import NodeLink
    from tests.unit.connector_fakes import Engine, identity

    def engine() -> Engine:
        return Engine(None, identity(), link_factory=lambda ns, pci="": NodeLink(node.addr, ns, "metrics-engine"))  # type: ignore[arg-type]

    prompt = [(i * 31 + 7) % 5000 for i in range(5 * 16 + 3)]  # 5 full blocks of 16 tokens
    first = engine()
    try:
        assert first.run(prompt)["external"] == 0
    finally:
        first.close()
    ns = identity().namespace(0)
    wait_until(lambda: stored_blocks(node, ns) >= 5, WAIT_S, "the engine's commits")
    loader = engine()
    try:
        assert loader.run(prompt)["external"] == 5 * 16
        for _ in range(failed_loads):
            def broken(*args: object, **kwargs: object) -> int:
                raise RuntimeError("a copy that fails (test)")
            loader.workers[0]._load_pages = broken  # noqa: SLF001 - the copy itself fails
            assert loader.run(prompt)["errors"], "the failed load's blocks are load errors"
    finally:
        loader.close()
    return EngineTraffic(saves=1, loads=1, load_failures=failed_loads)


def stored_blocks(node, namespace: str) -> int:  # type: ignore[no-untyped-def]
    return dict(node.stats().blocks_by_namespace).get(namespace, 0)


__all__ = ["EngineTraffic", "Traffic", "drive", "drive_engine", "drive_node", "node_args", "scrape",
           "start_metaserver", "value"]
