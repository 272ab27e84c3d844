"""The node's policy wiring: batched admission recording, the ceiling's request accounting,
its gauges, and the sketches the metaserver unites."""

from __future__ import annotations

import time

import xxhash
from prometheus_client import CollectorRegistry, generate_latest

from pegaflow.cluster.sketches import ClusterCeilingCollector, cluster_union
from pegaflow.core.block_index import BlockIndex
from pegaflow.core.identity import block_key, block_keys, namespace_salt
from pegaflow.node.accounting import RequestAccounting
from pegaflow.node.metrics import NodeMetrics
from pegaflow.policy.ceiling import CeilingEstimator
from pegaflow.policy.tinylfu import TinyLFU

PAGE = 4096


def hashes(tag: str, n: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{tag}:{i}".encode()) for i in range(n)]


class ScalarOnly:
    """The minimal Admission protocol: record and admit, no batch call."""

    def __init__(self) -> None:
        self.recorded: list[int] = []

    def record(self, key: int) -> None:
        self.recorded.append(key)

    def admit(self, candidate: int, victim: int) -> bool:
        return True


class Batching(ScalarOnly):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def record_many(self, keys: list[int]) -> None:
        self.calls += 1
        self.recorded.extend(keys)

    def record(self, key: int) -> None:  # must not be used when record_many exists
        raise AssertionError("record called although record_many exists")


def filled_index(admission: object, n: int = 8) -> tuple[BlockIndex, object, list[bytes]]:
    idx = BlockIndex(64 * PAGE, align=PAGE, admission=admission)  # type: ignore[arg-type]
    ns = idx.namespace("m", PAGE)
    hs = hashes("a", n)
    idx.commit([b for b in idx.reserve(ns, hs) if b is not None])
    return idx, ns, hs


def test_touch_and_record_access_use_one_record_many_call_per_request() -> None:
    adm = Batching()
    idx, ns, hs = filled_index(adm)
    adm.recorded.clear()
    adm.calls = 0
    assert len(idx.prefix(ns, hs)) == 8  # touch: one call for the 8 hits
    more = hashes("b", 5)
    idx.record_access(ns, more)  # one call for the 5 misses
    assert adm.calls == 2
    assert adm.recorded == [block_key(ns.salt, h) for h in hs + more]


def test_a_policy_without_record_many_still_sees_every_access_in_order() -> None:
    adm = ScalarOnly()
    idx, ns, hs = filled_index(adm)
    adm.recorded.clear()
    idx.prefix(ns, hs[:3])
    idx.record_access(ns, hs[5:])
    assert adm.recorded == [block_key(ns.salt, h) for h in hs[:3] + hs[5:]]


def test_tinylfu_in_the_index_counts_batched_accesses_like_scalar_ones() -> None:
    batched, scalar = TinyLFU(64), TinyLFU(64)
    idx, ns, hs = filled_index(batched)
    for _ in range(3):
        idx.prefix(ns, hs)
    keys = [block_key(ns.salt, h) for h in hs]
    for _ in range(4):  # the reserve that stored them (record_unseen), then three lookups
        for k in keys:
            scalar.record(k)
    assert list(batched.estimate_many(keys)) == list(scalar.estimate_many(keys))
    assert min(batched.estimate_many(keys)) >= 4


def test_a_block_stored_without_a_lookup_competes_for_admission_like_a_looked_up_one() -> None:
    """A saved decode block (or a prompt's last block) is reserved without a Query: never
    recorded, it lost every admission (0 against any victim, even a cold one) once the pool
    was full, while the block computed beside it was stored."""
    adm = TinyLFU(4)
    idx = BlockIndex(4 * PAGE, align=PAGE, admission=adm)
    ns = idx.namespace("m", PAGE)
    old = hashes("old", 4)
    idx.record_access(ns, old)
    idx.commit([b for b in idx.reserve(ns, old) if b is not None])
    assert len(idx.prefix(ns, old, touch=False)) == 4  # full
    victims = [block_key(ns.salt, h) for h in old]
    while max(adm.estimate_many(victims)):  # the sample period turns over: the victims go cold
        adm.record_many(list(range(10_000, 10_000 + adm.sample_size)))
    computed, saved = hashes("computed", 1), hashes("saved", 1)
    idx.record_access(ns, computed)  # the Query that missed it
    assert idx.reserve(ns, computed)[0] is not None
    assert idx.reserve(ns, saved)[0] is not None, "a block never looked up never admitted"
    assert idx.admission_rejections == 0


def test_ceiling_counts_each_request_once_however_often_it_is_queried() -> None:
    c = RequestAccounting((60.0,))
    hs = hashes("r", 10)
    assert c.observe("m", hs, 4, req_id="req-1")
    assert not c.observe("m", hs, 10, req_id="req-1")  # the engine re-asking: not a new request
    assert c.observe("m", hs, 10)  # no req_id: each query is a request
    s = c.estimator.stats(60.0)
    assert (s.requests, s.hits) == (20, 14)
    assert abs(s.distinct - 10) < 0.5
    assert abs(s.ceiling - 0.5) < 0.05


def test_ceiling_keys_depend_on_the_namespace_name_not_on_node_local_ids() -> None:
    h = hashes("k", 1)[0]
    # Same value in any process on any host (no salted hash(), no per-node namespace id).
    a, b = namespace_salt("model-a"), namespace_salt("model-b")
    assert block_key(a, h) == int.from_bytes(h[:8], "little") ^ namespace_salt("model-a")
    assert block_key(a, h) != block_key(b, h)
    assert list(block_keys(a, [h])) == [block_key(a, h)]  # what RequestAccounting feeds the sketches


def test_refresh_sets_the_window_gauges() -> None:
    m = NodeMetrics(CollectorRegistry())
    c = RequestAccounting((60.0, 3600.0), m)
    hs = hashes("g", 100)
    for i in range(4):  # 100 distinct blocks asked 4 times: r* = 0.75
        c.observe("m", hs, 50 if i else 0, req_id=f"q{i}")
    c.refresh()
    text = generate_latest(m.registry).decode()
    vals = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    for w in ("1m", "1h"):
        assert abs(vals[f'pegaflow_node_ceiling_hit_ratio{{window="{w}"}}'] - 0.75) < 0.01
        assert vals[f'pegaflow_node_measured_hit_ratio{{window="{w}"}}'] == 150 / 400
        assert vals[f'pegaflow_node_window_requested_blocks{{window="{w}"}}'] == 400
        assert vals[f'pegaflow_node_window_hit_blocks{{window="{w}"}}'] == 150


def test_admission_rejections_counter_reads_the_index() -> None:
    m = NodeMetrics(CollectorRegistry())
    box = {"n": 0}
    m.bind(admission_rejections=lambda: box["n"])
    box["n"] = 7
    assert "pegaflow_node_admission_rejections_total 7.0" in generate_latest(m.registry).decode()


class FakeRedis:
    """Just enough of redis-py for the sketch store: registry hash, GET/SET, pipeline."""

    def __init__(self, nodes: list[str]) -> None:
        import json

        self.data: dict[str, bytes] = {}
        self.nodes = {n.encode(): json.dumps({"nid": i, "epoch": 1, "addr": "x:1"}).encode()
                      for i, n in enumerate(nodes)}

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return dict(self.nodes)

    def set(self, key: str, value: bytes, px: int | None = None) -> None:
        self.data[key] = value

    def pipeline(self, transaction: bool = False) -> FakeRedis._Pipe:
        return FakeRedis._Pipe(self)

    class _Pipe:
        def __init__(self, r: FakeRedis) -> None:
            self.r, self.keys = r, []

        def get(self, key: str) -> None:
            self.keys.append(key)

        def execute(self) -> list[bytes | None]:
            return [self.r.data.get(k) for k in self.keys]


def test_cluster_union_counts_shared_blocks_once_and_sums_requests() -> None:
    now = time.time()
    a, b = CeilingEstimator((900.0,), clock=time.time), CeilingEstimator((900.0,), clock=time.time)
    a.observe(list(range(0, 2000)) * 2, hits=1000, now=now)  # 2000 distinct, asked twice
    b.observe(list(range(1000, 3000)), hits=100, now=now)  # 1000 of them shared with a
    est, merged, skipped = cluster_union({"a": a.serialize(), "b": b.serialize()}, (900.0,))
    assert est is not None and merged == ["a", "b"] and skipped == {}
    s = est.stats(900.0, now)
    assert (s.requests, s.hits) == (6000, 1100)
    assert abs(s.distinct - 3000) / 3000 < 0.01
    assert abs(s.ceiling - 0.5) < 0.01  # per node: 0.5 and 0.0; the union is not their mean


def test_collector_skips_sketches_of_other_windows_and_exports_the_union() -> None:
    r = FakeRedis(["a", "b", "c"])
    now = time.time()
    a, b = CeilingEstimator((900.0,), clock=time.time), CeilingEstimator((900.0,), clock=time.time)
    a.observe(list(range(100)) * 3, hits=200, now=now)
    b.observe(list(range(100)) * 3, hits=100, now=now)
    other = CeilingEstimator((60.0,), clock=time.time)
    other.observe([1, 2, 3], now=now)
    from pegaflow.cluster.sketches import publish_sketch

    publish_sketch(r, "a", a.serialize(), 10.0)  # type: ignore[arg-type]
    publish_sketch(r, "b", b.serialize(), 10.0)  # type: ignore[arg-type]
    publish_sketch(r, "c", other.serialize(), 10.0)  # type: ignore[arg-type]
    reg = CollectorRegistry()
    reg.register(ClusterCeilingCollector(r, (900.0,)))  # type: ignore[arg-type]
    text = generate_latest(reg).decode()
    vals = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    assert vals["pegaflow_meta_cluster_sketch_nodes"] == 2
    assert vals["pegaflow_meta_cluster_sketches_skipped"] == 1
    assert vals['pegaflow_meta_cluster_requested_blocks{window="15m"}'] == 600
    assert vals['pegaflow_meta_cluster_measured_hit_ratio{window="15m"}'] == 0.5
    assert abs(vals['pegaflow_meta_cluster_ceiling_hit_ratio{window="15m"}'] - 500 / 600) < 0.01


def outcomes(m: NodeMetrics) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    return {o: float(ln.split(" ")[1]) for o in ("l1", "ssd", "remote", "miss") for ln in text.splitlines()
            if ln.startswith(f'pegaflow_node_request_blocks_total{{outcome="{o}"}}')}


def test_outcomes_partition_each_request_by_the_tier_that_brought_each_block() -> None:
    m = NodeMetrics(CollectorRegistry())
    c = RequestAccounting((60.0,), m)
    hs = hashes("t", 20)
    # 3 blocks in L1; SSD promotes up to 8 (LOADING twice, same stage); a peer brings 8..14.
    c.loading("r", 3, "ssd")
    c.loading("r", 3, "ssd")
    c.loading("r", 8, "remote")
    assert c.observe("m", hs, 14, req_id="r")
    assert outcomes(m) == {"l1": 3, "ssd": 5, "remote": 6, "miss": 6}
    c.loading("r", 14, "ssd")  # a late answer for a counted request changes nothing
    assert not c.observe("m", hs, 20, req_id="r")
    # A promotion that fell short (evicted meanwhile): the READY prefix bounds every tier.
    c.loading("s", 5, "ssd")
    assert c.observe("m", hs, 4, req_id="s")
    assert outcomes(m) == {"l1": 7, "ssd": 5, "remote": 6, "miss": 22}
    # Without a req_id a LOADING answer cannot be linked: the READY prefix counts as l1.
    c.loading("", 2, "ssd")
    assert c.observe("m", hs[:5], 5)
    assert outcomes(m) == {"l1": 12, "ssd": 5, "remote": 6, "miss": 22}
