"""An engine's copy times reach a real node's metrics: the connector's worker times each
save and load batch and counts the load batches that fail, its scheduler side sends them on
the Commits and Releases it sends anyway (node.proto, ``CopyTimes``), and the node exports
them as ours (``pegaflow_node_save_copy_seconds``, ...) and under the original's names
(``pegaflow_save_duration_seconds``, ``pegaflow_load_duration_seconds``,
``pegaflow_load_failures_total``) with the original's buckets. A report the node cannot
take (a negative or non-finite duration, too many) is INVALID_ARGUMENT and commits nothing."""

from __future__ import annotations

import math

import grpc
import pytest

from pegaflow.client import CopyTimes, NodeError, PegaClient
from pegaflow.common.validate import MAX_COPY_TIMES
from pegaflow.node.metrics import COPY_BUCKETS, ORIGINAL_COPY_BUCKETS
from tests.integration.metrics_stack import WAIT_S, drive_engine, hashes, scrape, value
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def bounds(samples: dict, series: str) -> list[float]:
    return sorted(float(lb["le"]) for lb, _ in samples.get(series, []))


def test_an_engines_save_load_and_failed_load_reach_the_nodes_histograms(node_factory) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("16mb")
    t = drive_engine(node, failed_loads=1)
    # Commits and Releases are sent without waiting for their answer.
    wait_until(lambda: node.metric("pegaflow_node_load_copy_failures_total") == t.load_failures
               and node.metric("pegaflow_node_load_copy_seconds_count") == t.loads, WAIT_S,
               "the load times and the failure to reach the node")
    _, s = scrape(node.http_port)
    assert value(s, "pegaflow_node_save_copy_seconds_count") == t.saves
    assert 0 < value(s, "pegaflow_node_save_copy_seconds_sum") < 10
    assert 0 < value(s, "pegaflow_node_load_copy_seconds_sum") < 10
    for ours, orig in (("pegaflow_node_save_copy_seconds", "pegaflow_save_duration_seconds"),
                       ("pegaflow_node_load_copy_seconds", "pegaflow_load_duration_seconds")):
        assert value(s, orig + "_count") == value(s, ours + "_count") and value(s, orig + "_sum") == value(
            s, ours + "_sum"), orig
        # Ours has finer bounds below the original's first (10 ms); its name has the original's.
        assert bounds(s, ours + "_bucket") == [*COPY_BUCKETS, math.inf]
        assert bounds(s, orig + "_bucket") == [*ORIGINAL_COPY_BUCKETS, math.inf]
        for le in ORIGINAL_COPY_BUCKETS:  # the same cumulative counts at every bound both have
            assert value(s, orig + "_bucket", le=str(le)) == value(s, ours + "_bucket", le=str(le)), (orig, le)
    assert value(s, "pegaflow_load_failures_total") == value(s, "pegaflow_node_load_copy_failures_total") == 1


def test_a_report_the_node_cannot_take_is_invalid_and_commits_nothing(node_factory) -> None:  # type: ignore[no-untyped-def]
    node = node_factory("16mb")
    with PegaClient(node.addr) as c:
        c.register({"copy-model": 4096})
        hs = hashes("bad-report", 2)
        r = c.reserve("copy-model", hs)
        for bad in (CopyTimes(save_seconds=(-0.5,)), CopyTimes(load_seconds=(math.nan,)),
                    CopyTimes(save_seconds=(math.inf,)), CopyTimes(load_seconds=(0.001,) * (MAX_COPY_TIMES + 1))):
            with pytest.raises(NodeError) as err:
                c.commit(r.reservation_id, copies=bad)
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert "copies." in str(err.value) and "\n" not in str(err.value)
        assert c.stats().active_reservations == 1 and node.metric("pegaflow_node_save_copy_seconds_count") == 0
        assert c.commit(r.reservation_id, copies=CopyTimes(save_seconds=(0.002,))) == 2
        assert node.metric("pegaflow_node_save_copy_seconds_count") == 1
        q = c.query(["copy-model"], hs)
        with pytest.raises(NodeError):
            c.release(q.lease_id, copies=CopyTimes(load_seconds=(-1.0,)))
        assert c.stats().active_leases == 1, "a bad report releases nothing"
        c.release(q.lease_id, copies=CopyTimes(load_seconds=(0.003,), load_failures=2))
        assert node.metric("pegaflow_node_load_copy_seconds_count") == 1
        assert node.metric("pegaflow_load_failures_total") == 2
