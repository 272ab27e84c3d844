"""--metric-hll-bucket-bits: the node's ceiling sketches use the bits asked for, and the
metaserver's union leaves out (and says so, once) a node whose bits differ from its own,
whichever node sorts first."""

from __future__ import annotations

import struct
import time

import pytest
from structlog.testing import capture_logs

from pegaflow.cluster.sketches import ClusterCeilingCollector, cluster_union, publish_sketch
from pegaflow.config.commands import load
from pegaflow.config.options import META, NODE
from pegaflow.node.accounting import RequestAccounting
from pegaflow.policy.ceiling import CeilingEstimator
from tests.unit.test_node_policy import FakeRedis


def test_the_flag_reaches_both_daemons_configs_with_the_originals_default() -> None:
    assert load(NODE, "n", []).metric_hll_bucket_bits == 16
    assert load(META, "m", []).metric_hll_bucket_bits == 16
    assert load(NODE, "n", ["--metric-hll-bucket-bits", "12"]).metric_hll_bucket_bits == 12
    assert load(META, "m", ["--metric-hll-bucket-bits", "18"]).metric_hll_bucket_bits == 18


def test_node_accounting_uses_the_bits_even_beyond_the_default_budget() -> None:
    for bits in (4, 12, 16, 18):
        acc = RequestAccounting((900.0, 3600.0, 86400.0), lg_k=bits)
        assert acc.estimator.lg_k == bits
        acc.observe("ns", [i.to_bytes(16, "little") for i in range(1000)], 0)
        blob = acc.serialize()
        assert CeilingEstimator.deserialize(blob).lg_k == bits
    # Fewer registers: a larger error, as the original's 1.04/sqrt(2^bits).
    assert RequestAccounting((900.0,), lg_k=10).estimator.rel_error() > RequestAccounting(
        (900.0,), lg_k=16
    ).estimator.rel_error()


def sketch(bits: int, keys: range) -> bytes:
    est = CeilingEstimator((900.0,), lg_k=bits, clock=time.time)
    est.observe(list(keys), hits=0, now=time.time())
    return est.serialize()


def test_union_skips_nodes_of_other_bits_even_when_they_sort_first() -> None:
    blobs = {"a-odd": sketch(14, range(500)), "b": sketch(16, range(1000)), "c": sketch(16, range(500, 1500))}
    est, merged, skipped = cluster_union(blobs, (900.0,), lg_k=16)
    assert est is not None and est.lg_k == 16
    assert merged == ["b", "c"]
    assert list(skipped) == ["a-odd"]
    assert "HLL bucket bits 14 != this metaserver's --metric-hll-bucket-bits 16" in skipped["a-odd"]
    assert est.stats(900.0).requests == 2000  # the 500 of the odd node are not in N
    # A metaserver at 14 takes the odd one and leaves the others out.
    est, merged, skipped = cluster_union(blobs, (900.0,), lg_k=14)
    assert est is not None and merged == ["a-odd"] and sorted(skipped) == ["b", "c"]


def test_collector_counts_and_logs_a_mismatch_once_per_node() -> None:
    r = FakeRedis(["a", "b"])
    publish_sketch(r, "a", sketch(12, range(100)), 10.0)  # type: ignore[arg-type]
    publish_sketch(r, "b", sketch(16, range(100)), 10.0)  # type: ignore[arg-type]
    coll = ClusterCeilingCollector(r, (900.0,), min_interval=0.0, lg_k=16)  # type: ignore[arg-type]
    with capture_logs() as logs:
        for _ in range(3):
            stats, merged, skipped = coll.compute()
            assert (merged, skipped) == (1, 1)
    warned = [e for e in logs if e["event"] == "ceiling_sketch_skipped"]
    assert len(warned) == 1 and warned[0]["node"] == "a"
    assert "bucket bits 12" in warned[0]["error"]


def corrupt(blob: bytes) -> bytes:
    """``blob`` with its last sketch image claiming more bucket bits than its bytes hold
    (datasketches raises IndexError on it, not ValueError)."""
    est = CeilingEstimator.deserialize(blob, clock=time.time)
    off, images = 9 + 8 * len(est.windows), []  # the header ("<4sBBHB") and the windows: the first slot
    while off < len(blob):
        size = struct.unpack_from("<qQQI", blob, off)[3]  # (index, n, hits, image bytes)
        off += 28
        if size:
            images.append((off, size))
        off += size
    at, size = images[-1]  # the last image: a merge reads the others first
    assert len(images) > 1 and size > 1000 and blob[at + 3] == est.lg_k  # dense; its byte 3 is its lg_k
    return blob[:at + 3] + bytes([est.lg_k + 4]) + blob[at + 4:]


def test_a_sketch_datasketches_cannot_read_is_skipped_not_raised() -> None:
    """One corrupt sketch in Redis raised out of the collector: every metric of the
    metaserver's /metrics page (one registry) and its ClusterCeiling RPC failed with it."""
    # Dense (the image's size follows its lg_k), and a sketch in a later window too: a merge
    # that failed partway must leave nothing of it behind.
    good = CeilingEstimator((900.0,), lg_k=16, clock=time.time)
    good.observe(list(range(100_000)), hits=0, now=time.time() - 300)
    good.observe(list(range(100_000)), hits=0, now=time.time())
    bad = corrupt(good.serialize())
    for blobs in ({"a": bad, "b": sketch(16, range(100))}, {"a": sketch(16, range(100)), "b": bad}):
        est, merged, skipped = cluster_union(blobs, (900.0,), lg_k=16)
        assert est is not None and est.stats(900.0).requests == 100
        assert merged == [n for n in blobs if blobs[n] is not bad] and list(skipped) == [n for n in blobs if blobs[n] is bad]
    from prometheus_client import CollectorRegistry, generate_latest

    r = FakeRedis(["a", "b"])
    publish_sketch(r, "a", bad, 10.0)  # type: ignore[arg-type]
    publish_sketch(r, "b", sketch(16, range(100)), 10.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CeilingEstimator.deserialize(bad)
    reg = CollectorRegistry()
    reg.register(ClusterCeilingCollector(r, (900.0,), min_interval=0.0, lg_k=16))  # type: ignore[arg-type]
    assert b"pegaflow_meta_cluster_sketch_nodes" in generate_latest(reg)
