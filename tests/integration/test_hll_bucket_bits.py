"""--metric-hll-bucket-bits across processes: two real nodes publish their ceiling sketches
to a real redis-server, one at 14 bits and one at the default 16; a real metaserver at 16
unites only the node that agrees with it, counts the other as skipped and logs why, once."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegaflow.client import PegaClient
from pegaflow.policy.ceiling import CeilingEstimator
from tests.harness.meta import MetaServer
from tests.harness.procs import log_events
from tests.harness.redis import RedisServer
from tests.integration import redis_fixtures
from tests.integration.test_cluster_ceiling import NS, hashes, run_requests, scrape
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server


def test_metaserver_leaves_out_a_node_of_other_bucket_bits(node_factory, redis_server: RedisServer,
                                                           tmp_path: Path) -> None:
    from pegaflow.cluster import keys
    from pegaflow.cluster.redis_conn import connect

    common = ["--redis-url", redis_server.url, "--ceiling-publish-interval", "0.3", "--liveness-ttl", "5"]
    odd = node_factory(extra=[*common, "--node-id", "bits-14", "--metric-hll-bucket-bits", "14"])
    even = node_factory(extra=[*common, "--node-id", "bits-16"])
    meta = MetaServer(redis_server.url, tmp_path / "meta.log", http=True,
                      extra=["--sweep-interval", "0", "--log-format", "json"]).start()
    meta_http = meta.http_port
    try:
        hs = hashes(400)
        for n, tag in ((odd, "odd"), (even, "even")):
            c = PegaClient(n.addr)
            c.register({NS: 16 << 10})
            run_requests(c, tag, hs, repeat=1)
            c.close()
        # Each node's sketch carries its own bits.
        r = connect(redis_server.url, False)
        wait_until(lambda: r.get(keys.sketch_key("bits-14")) is not None, 15, "the 14-bit node's sketch")
        assert CeilingEstimator.deserialize(r.get(keys.sketch_key("bits-14"))).lg_k == 14
        wait_until(lambda: r.get(keys.sketch_key("bits-16")) is not None, 15, "the 16-bit node's sketch")
        assert CeilingEstimator.deserialize(r.get(keys.sketch_key("bits-16"))).lg_k == 16
        r.close()

        def settled() -> bool:
            try:
                m = scrape(meta_http)
            except OSError:
                return False
            return (m.get("pegaflow_meta_cluster_sketch_nodes") == 1
                    and m.get("pegaflow_meta_cluster_sketches_skipped") == 1
                    and m.get('pegaflow_meta_cluster_requested_blocks{window="15m"}') == 400)

        wait_until(settled, 30, "the metaserver to unite the 16-bit node only", every=0.3)

        def skip_lines() -> list[dict]:
            return log_events(meta.log(), "ceiling_sketch_skipped")

        wait_until(lambda: skip_lines(), 10, "the metaserver's log of the skipped sketch")
        for _ in range(3):  # later scrapes: the same reason is not logged again
            scrape(meta_http)
        lines = skip_lines()
        assert [x["node"] for x in lines] == ["bits-14"], lines
        assert "--metric-hll-bucket-bits 16" in lines[0]["error"] and "bits 14" in lines[0]["error"]
    finally:
        meta.stop()
