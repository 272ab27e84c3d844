"""A replica's in-memory view (pegaflow/meta/view_feed.py) on a real redis-server, fed from the
node streams beside the consumer: it ends equal to the Redis index and to the nodes' own truth
for every visible node, through node restarts, dead nodes and more incarnations than it has
slots; lookups through a real ``pegaflow-meta`` are answered from it and equal the truth; at
full ingest every answer it gives holds what was written longer than its bound ago, and
lookups read Redis once it is older than its bound."""

from __future__ import annotations

import gc
import hashlib
import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pegaflow.cluster import keys
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import Client
from pegaflow.common.heap import freeze_startup_heap
from pegaflow.meta.events.consumer import Consumer
from pegaflow.meta.index import Index
from pegaflow.meta.lookup import Lookup
from pegaflow.meta.metrics import MetaMetrics
from pegaflow.meta.view import MAX_SLOTS
from pegaflow.meta.view_feed import ViewFeed
from pegaflow.node.publishing import EventPublisher
from tests.harness.meta import MetaServer
from tests.harness.procs import python_env
from tests.harness.redis import RedisClusterProc, RedisServer
from tests.integration import redis_fixtures
from tests.integration.meta_harness import (
    LEASE_TTL_S,
    PublisherProc,
    client,
    index_view,
    load_truth,
    wait_converged,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
redis_server = redis_fixtures.redis_server
redis_cluster = redis_fixtures.redis_cluster

BOUND_S = 0.1  # --view-max-lag-ms's default


@pytest.fixture
def feed(redis_server: RedisServer) -> Iterator[ViewFeed]:
    """A view fed in this process (the metaserver's, minus gRPC), stale filtering as the default."""
    f = ViewFeed(client(redis_server.url, False), BOUND_S, stale_ms=30_000)
    f.start()
    try:
        yield f
    finally:
        f.stop()


def by_tag(dump: dict[tuple[str, bytes], frozenset[str]] | None) -> dict[tuple[str, bytes], frozenset[str]] | None:
    return None if dump is None else {(keys.ns_tag(ns), h): nodes for (ns, h), nodes in dump.items()}


def wait_view_equals_index(r: Client, feed: ViewFeed, truth: dict | None = None, timeout: float = 30) -> None:
    """Until the view holds what the Redis index holds for the visible nodes (and ``truth``)."""
    last: list = []

    def same() -> bool:
        view, index = by_tag(feed.dump()), index_view(r)
        last[:] = [view, index]
        return view == index and (truth is None or view == truth)

    def diff() -> str:
        view, index = last
        if view is None:
            return "the view to be in use"
        return (f"view == index: {len(view)} blocks in the view, {len(index)} in the index, "
                f"{len(set(view) ^ set(index))} in one only")

    wait_until(same, timeout, diff, every=0.2)


def expected(truth: dict[tuple[str, bytes], frozenset[str]], ns: str, hs: list[bytes]) -> dict[str, int]:
    """node -> prefix of ``hs`` it holds, from the nodes' truth (QueryPrefix's answer)."""
    tag = keys.ns_tag(ns)
    out: dict[str, int] = {}
    alive: set[str] | None = None
    for i, h in enumerate(hs):
        holders = truth.get((tag, h), frozenset())
        alive = set(holders) if alive is None else alive & holders
        for n in alive:
            out[n] = i + 1
        if not alive:
            break
    return out


def queries(states: dict[str, Path], n: int, seed: int) -> Iterator[tuple[str, list[bytes]]]:
    """Lookups mixing prefixes of one node's blocks with others' and unknown ones."""
    rng = random.Random(seed)
    held = {node: json.loads(p.read_text()) for node, p in states.items()}
    for _ in range(n):
        node = rng.choice(sorted(held))
        ns = rng.choice(sorted(held[node]))
        mine = [bytes.fromhex(h) for h in held[node][ns]]
        if not mine:
            continue
        hs = rng.sample(mine, min(len(mine), rng.randint(1, 40)))
        other = rng.choice(sorted(held))
        theirs = [bytes.fromhex(h) for h in held[other].get(ns, [])]
        hs += rng.sample(theirs, min(len(theirs), rng.randint(0, 10))) + [rng.randbytes(16)]
        yield ns, hs


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_view_equals_the_index_and_the_truth_through_restarts_and_deaths(
    redis_server: RedisServer, feed: ViewFeed, tmp_path: Path
) -> None:
    r = client(redis_server.url, False)
    c = Consumer(r, Index(r), "c", lease_ms=int(LEASE_TTL_S * 1000))
    stop = threading.Event()
    consumer = threading.Thread(target=c.run, args=(stop,), daemon=True)
    consumer.start()
    procs = {n: PublisherProc(redis_server.url, False, n, tmp_path / f"{n}.json", tmp_path / f"{n}.log", "--seed",
                              str(i), "--ops", "600", "--rate", "1500", "--hold", "--ttl", "2")
             for i, n in enumerate(["n1", "n2", "n3"])}
    try:
        for p in procs.values():
            p.wait_done()
        states = {n: p.state for n, p in procs.items()}
        wait_converged(r, states)
        truth = load_truth(states)
        assert len(truth) > 1000
        wait_view_equals_index(r, feed, truth)
        assert feed.incarnations() == 3
        # A restarted node: a new incarnation with what survived; the old one's slot is cleared.
        procs["n1"].kill()
        procs["n1"] = PublisherProc(redis_server.url, False, "n1", states["n1"], tmp_path / "n1b.log", "--ops", "100",
                                    "--keep", "150", "--seed", "9", "--hold", "--ttl", "2")
        procs["n1"].wait_done()
        wait_converged(r, states)
        wait_view_equals_index(r, feed, load_truth(states))
        wait_until(lambda: feed.incarnations() == 3, 10, "the old incarnation's slot to be cleared")
        # A dead node leaves the view's answers once its liveness expires.
        procs["n2"].kill()
        del states["n2"]
        wait_view_equals_index(r, feed, load_truth(states), timeout=15)
        assert feed.restarts == 0
    finally:
        stop.set()
        for p in procs.values():
            p.kill()
        consumer.join(10)


def test_on_a_cluster_the_view_equals_the_index(redis_cluster: RedisClusterProc, tmp_path: Path) -> None:
    """Streams on several shards: one XREAD per stream, every shard written before any is read."""
    redis_cluster.flush()
    r = client(redis_cluster.url, True)
    feed = ViewFeed(r, BOUND_S, stale_ms=30_000)
    feed.start()
    c = Consumer(r, Index(r), "c", lease_ms=int(LEASE_TTL_S * 1000))
    stop = threading.Event()
    consumer = threading.Thread(target=c.run, args=(stop,), daemon=True)
    consumer.start()
    names = ["n1", "n2", "n3", "n4"]
    procs = {n: PublisherProc(redis_cluster.url, True, n, tmp_path / f"{n}.json", tmp_path / f"{n}.log", "--seed",
                              str(i), "--ops", "300", "--namespaces", "3", "--hold")
             for i, n in enumerate(names)}
    try:
        assert len({r.get_node_from_key(stream_key(n)).name for n in names}) > 1
        for p in procs.values():
            p.wait_done(90)
        states = {n: p.state for n, p in procs.items()}
        wait_converged(r, states)
        wait_view_equals_index(r, feed, load_truth(states))
    finally:
        stop.set()
        for p in procs.values():
            p.kill()
        consumer.join(10)
        feed.stop()


def test_more_incarnations_over_time_than_slots_reuse_cleared_slots(
    redis_server: RedisServer, feed: ViewFeed
) -> None:
    """A node restarted past 64 times: each restart supersedes the last incarnation, whose slot
    is cleared and given to a later one; the view never overflows and ends equal to the index."""
    r = client(redis_server.url, False)
    rng = random.Random(4)
    held = [rng.randbytes(16) for _ in range(400)]
    c = Consumer(r, Index(r), "c")
    for k in range(MAX_SLOTS + 6):
        keep = held[: 100 + k]
        pub = EventPublisher(r, "n1", "h:1", lambda keep=keep: [("ns", keep)], flush_interval=0.001).start(wait=5)
        pub.on_insert("ns", held[300 + k : 301 + k])
        assert pub.wait_idle(5)
        pub.stop()
        if k % 16 == 15:  # the view catches up now and then, slots freed meanwhile
            assert c.wait_caught_up(10)
            wait_view_equals_index(r, feed)
    assert c.wait_caught_up(10)
    wait_view_equals_index(r, feed)
    wait_until(lambda: feed.incarnations() == 1, 10, "every superseded slot cleared")
    assert feed.restarts == 0


def test_lookups_through_grpc_are_answered_from_the_view_and_equal_the_truth(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # The writers are done before the lookups: what is checked is that the view answers them and
    # equals the truth, not the lag bound (tests above). A bound of 2 s keeps a feeder thread
    # starved on a loaded host (a parallel run sent 127 of 300 lookups to Redis at 100 ms) from
    # turning this into a timing test.
    meta = MetaServer(redis_server.url, tmp_path / "meta.log", http=True,
                      extra=["--consumer-name", "m1", "--stream-lease-ttl", str(LEASE_TTL_S), "--sweep-interval", "0",
                             "--view-max-lag-ms", "2000"])
    meta.start()
    procs = {n: PublisherProc(redis_server.url, False, n, tmp_path / f"{n}.json", tmp_path / f"{n}.log", "--seed",
                              str(i), "--ops", "500", "--hold")
             for i, n in enumerate(["n1", "n2", "n3"])}
    r = client(redis_server.url, False)
    try:
        for p in procs.values():
            p.wait_done()
        states = {n: p.state for n, p in procs.items()}
        wait_converged(r, states)
        truth = load_truth(states)
        assert meta.http_port is not None
        wait_until(lambda: sample(scrape(meta.http_port), "pegaflow_meta_view_lag_seconds") < BOUND_S, 20,
                   "the metaserver's view to catch up")
        before = scrape(meta.http_port)
        checked = 0
        for ns, hs in queries(states, 300, seed=1):
            assert meta.query(ns, hs) == expected(truth, ns, hs), (ns, len(hs))
            checked += 1
        after = scrape(meta.http_port)
        from_view = (sample(after, 'pegaflow_meta_lookups_total{source="view"}')
                     - sample(before, 'pegaflow_meta_lookups_total{source="view"}'))
        assert checked > 250 and from_view >= 0.9 * checked, (checked, from_view)
        assert sample(after, "pegaflow_meta_view_blocks") == len(truth)
        assert sample(after, "pegaflow_meta_view_bytes") > 32 * len(truth)
    finally:
        for p in procs.values():
            p.kill()
        meta.stop()


# A node's stream written as fast as one process can: chains of 128 blocks, 4 to an entry,
# 16 entries to a pipeline; after each pipeline the last chain written goes to test:done.
WRITER = """
import hashlib, sys, time
from pegaflow.cluster import registry
from pegaflow.cluster.keys import stream_key
from pegaflow.cluster.redis_conn import connect
from pegaflow.meta.events.codec import FIELD, encode
from pegaflow.meta.events.schema import Event, Op
r = connect(sys.argv[1])
seconds, rate = float(sys.argv[2]), float(sys.argv[3])
nid, epoch = registry.register(r, "w", "h:w", 600_000, switch=True)
r.xadd(stream_key("w"), {FIELD: encode(Event("w", nid, epoch, 0, Op.RESET))})
def chain(c):
    return b"".join(hashlib.blake2b(b"%d:%d" % (c, j), digest_size=16).digest() for j in range(128))
seq, c, t0 = 1, 0, time.monotonic()
print("ready", flush=True)
while time.monotonic() - t0 < seconds:
    p = r.pipeline(transaction=False)
    for _ in range(16):
        p.xadd(stream_key("w"), {FIELD: encode(Event("w", nid, epoch, seq, Op.INSERT, "ns",
                                                       b"".join(chain(c + k) for k in range(4))))})
        seq, c = seq + 1, c + 4
    p.set("test:done", c - 1)
    p.execute()
    if rate:
        time.sleep(max(0.0, c * 128 / rate - (time.monotonic() - t0)))
print(c * 128, time.monotonic() - t0, flush=True)
"""


def chain(c: int) -> list[bytes]:
    return [hashlib.blake2b(b"%d:%d" % (c, j), digest_size=16).digest() for j in range(128)]


@pytest.mark.serial  # the writer must reach 500k blocks/s: the machine's cores to itself
@pytest.mark.parametrize("rate", [500_000, 0], ids=["500k-blocks-per-s", "unthrottled"])
def test_at_full_ingest_view_answers_hold_everything_older_than_the_bound(
    redis_server: RedisServer, feed: ViewFeed, rate: int, request: pytest.FixtureRequest
) -> None:
    """A writer fills a node's stream (500k blocks/s, then as fast as it can) while lookups
    run. Each check notes the last chain written, waits the bound, and asks for it: an answer
    from the view must hold it whole (else the view missed an event older than the bound);
    None means the caller reads Redis. At 500k blocks/s the view keeps up and answers most."""
    # The feeder runs in this pytest worker, whose heap holds vLLM's modules and every earlier
    # test's objects (a full collection took 0.4 s here with vLLM alone loaded; once a pause
    # stalled the feeder 1.2 s, and 12 checks in a row read Redis). A metaserver freezes its
    # start-up heap (pegaflow/common/heap.py): so does the test, for its window.
    freeze_startup_heap()
    request.addfinalizer(gc.unfreeze)
    r = client(redis_server.url, False)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, redis_server.url, "6", str(rate)], env=python_env(),
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "ready"
    wait_until(lambda: r.get("test:done") is not None, 10, "the writer's first chains")
    answered = fell_back = 0
    lags: list[float] = []
    while writer.poll() is None:
        done, t0 = int(r.get("test:done") or 0), time.monotonic()
        lags.append(feed.lag_s())
        time.sleep(max(0.0, t0 + BOUND_S - time.monotonic()))
        rows = feed.holders("ns", chain(done))
        if rows is None:
            fell_back += 1
        else:
            assert rows == [("w", "h:w", 128, 0)], (done, rows)
            answered += 1
    out = writer.stdout.read().split()
    blocks, seconds = int(out[0]), float(out[1])
    lags.sort()
    print(f"{blocks / seconds:,.0f} blocks/s written; {answered} answered from the view, {fell_back} fell back; "
          f"lag p50 {lags[len(lags) // 2] * 1e3:.1f} ms, max {lags[-1] * 1e3:.1f} ms")
    assert writer.returncode == 0 and answered + fell_back > 20
    if rate:
        assert blocks / seconds > 0.8 * rate, "the writer did not reach its rate"
        assert answered >= 0.8 * (answered + fell_back), (answered, fell_back, lags[-5:])
    # Once the writer stops the view catches up and answers everything written.
    last = int(r.get("test:done") or 0)
    wait_until(lambda: feed.holders("ns", chain(last)) == [("w", "h:w", 128, 0)], 30, "the view to catch up")


def test_a_view_older_than_its_bound_is_not_read(redis_server: RedisServer) -> None:
    """A feeder that stops stepping (stalled, stuck on Redis) leaves the view out of use within
    its bound: lookups read Redis from then on, and count it."""
    r = client(redis_server.url, False)
    rng = random.Random(2)
    held = [rng.randbytes(16) for _ in range(64)]
    pub = EventPublisher(r, "n1", "h:1", lambda: [("ns", held)], flush_interval=0.001).start(wait=5)
    assert Consumer(r, Index(r), "c").wait_caught_up(10)
    feed = ViewFeed(r, BOUND_S, stale_ms=30_000)  # stepped by hand: no thread
    metrics = MetaMetrics(CollectorRegistry())
    lookup = Lookup(r, 30_000, view=feed, sources=metrics.lookups)

    def count(source: str) -> float | None:
        return metrics.registry.get_sample_value("pegaflow_meta_lookups_total", {"source": source})

    wait_until(lambda: (feed.step(), feed.holders("ns", held) is not None)[1], 10, "the view in use", every=0.01)
    assert lookup.query_prefix("ns", held)[0].prefix_len == 64
    assert (count("view"), count("redis")) == (1, 0)
    wait_until(lambda: feed.holders("ns", held) is None, 2 * BOUND_S + 1, "the view to be older than its bound",
               every=0.01)
    assert lookup.query_prefix("ns", held)[0].prefix_len == 64  # from Redis
    assert (count("view"), count("redis")) == (1, 1)
    pub.stop()


def test_the_view_counts_every_block_update_it_applies_once(redis_server: RedisServer) -> None:
    """``pegaflow_meta_view_updates_total`` (the view's ingest, what bench/meta.py times) counts
    each hash of a node's SNAPSHOT, INSERT and EVICT events once: as many as the consumer
    applies to Redis from the same stream."""
    r = client(redis_server.url, False)
    rng = random.Random(4)
    held = [rng.randbytes(16) for _ in range(48)]
    more = [rng.randbytes(16) for _ in range(20)]
    pub = EventPublisher(r, "n1", "h:1", lambda: [("ns", held)], flush_interval=0.001).start(wait=5)
    pub.on_insert("ns", more)
    pub.on_evict("ns", held[:10])
    written = len(held) + len(more) + 10
    consumer = Consumer(r, Index(r), "c")
    wait_until(lambda: consumer.wait_caught_up(1) and consumer.stats.blocks == written, 10,
               lambda: f"the consumer to apply {written} updates (applied {consumer.stats.blocks})")
    feed = ViewFeed(r, BOUND_S, stale_ms=30_000)  # stepped by hand: no thread
    metrics = MetaMetrics(CollectorRegistry())
    metrics.bind_view(feed)
    wait_until(lambda: (feed.step(), feed.holders("ns", more) is not None)[1], 10, "the view in use", every=0.01)
    for _ in range(3):
        feed.step()  # nothing new: nothing counted again
    assert feed.updates == written
    assert metrics.registry.get_sample_value("pegaflow_meta_view_updates_total") == written
    assert feed.holders("ns", held[10:]) == [("n1", "h:1", len(held) - 10, 0)]
    pub.stop()


def test_an_idle_feeder_backs_off_and_reads_the_first_event_after_a_quiet_spell(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While nothing is new the feeder's rounds slow down to one per ``idle_s`` (a quarter of
    the bound), not one per ``poll_s``; an event written after the quiet spell is in the view's
    answers soon after, and so are the node's later ones."""
    r = client(redis_server.url, False)
    rng = random.Random(3)
    held = [rng.randbytes(16) for _ in range(32)]
    pub = EventPublisher(r, "n1", "h:1", lambda: [("ns", held)], flush_interval=0.001).start(wait=5)
    f = ViewFeed(r, BOUND_S, stale_ms=30_000)
    assert f.idle_s == BOUND_S / 4 and f.poll_s < f.idle_s
    rounds = 0
    step = f.step

    def counted() -> bool:
        nonlocal rounds
        rounds += 1
        return step()

    monkeypatch.setattr(f, "step", counted)
    f.start()
    try:
        wait_until(lambda: f.holders("ns", held) is not None, 10, "the view in use")
        t0, n0 = time.monotonic(), rounds
        wait_until(lambda: time.monotonic() - t0 >= 1.0, 5, "a quiet second", every=0.05)
        per_s = (rounds - n0) / (time.monotonic() - t0)
        # At poll_s (5 ms) a quiet second held ~200 rounds; backed off, at most 1 / idle_s (40).
        assert 0 < per_s <= 1.25 / f.idle_s, per_s
        later = held + [rng.randbytes(16) for _ in range(8)]
        pub.on_insert("ns", later[len(held):])

        def prefix() -> int:
            rows = f.holders("ns", later)
            return rows[0][2] if rows else 0

        wait_until(lambda: prefix() == len(later), 10, "the view to hold the blocks written after the quiet spell")
    finally:
        f.stop()
        pub.stop()
