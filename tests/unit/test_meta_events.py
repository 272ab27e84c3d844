"""Unit tests of the event codec, the index scripts and the registry, on fakeredis (Lua via lupa)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import fakeredis
import pytest

from pegaflow.cluster import keys, registry
from pegaflow.cluster.keys import stream_key
from pegaflow.core.identity import HASH_BYTES
from pegaflow.meta.events.codec import FIELD, MalformedEvent, decode, encode
from pegaflow.meta.events.consumer import Consumer
from pegaflow.meta.events.schema import FLAG_LAST, Event, Op
from pegaflow.meta.index import Index
from pegaflow.node.publishing import EventPublisher
from tests.waiting import wait_until

NS = "llama|fp16|bs16|tp1"


def hashes(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def publish(r: fakeredis.FakeRedis, ev: Event) -> None:
    """``ev`` appended to its node's stream, as the node's publisher writes it."""
    r.xadd(stream_key(ev.node), {FIELD: encode(ev)})


def steps(c: Consumer, n: int = 3) -> None:
    for _ in range(n):
        c.step()


@pytest.fixture
def r() -> fakeredis.FakeRedis:
    pytest.importorskip(
        "lupa", reason="fakeredis runs Lua scripts only with lupa (pip install 'fakeredis[lua]')"
    )
    return fakeredis.FakeRedis()


# --- codec ---------------------------------------------------------------------------------


def test_codec_round_trips_every_field() -> None:
    hs = hashes(300)
    ev = Event.make("node-a", 7, 3, 42, Op.EVICT, NS, hs, flags=FLAG_LAST)
    data = encode(ev)
    assert len(data) == 32 + len("node-a") + len(NS) + 300 * 16
    back = decode(data)
    assert back == ev
    assert back.hashes == hs and back.last and back.count == 300


def test_codec_rejects_malformed_bytes() -> None:
    good = encode(Event.make("n", 1, 1, 1, Op.INSERT, NS, hashes(3)))
    bad = [
        b"",
        good[:10],
        good[:-1],  # truncated hash
        good + b"x",  # trailing garbage
        b"\x02" + good[1:],  # unknown version
        good[:1] + b"\x09" + good[2:],  # unknown op
    ]
    for data in bad:
        with pytest.raises(MalformedEvent):
            decode(data)
    with pytest.raises(ValueError):
        Event.make("n", 1, 1, 1, Op.INSERT, NS, [b"short"])


def test_stream_names_use_a_hash_tag_per_node() -> None:
    assert stream_key("host-1") == "pf:ev:{host-1}"
    with pytest.raises(ValueError):
        stream_key("a{b}")


# --- index scripts ---------------------------------------------------------------------------


def test_apply_is_idempotent_and_evict_removes_only_that_node(r: fakeredis.FakeRedis) -> None:
    ix = Index(r)
    hs = hashes(50)
    assert ix.apply(Op.INSERT, NS, 1, hs) == 50
    assert ix.apply(Op.INSERT, NS, 1, hs) == 0  # again: nothing changes
    assert ix.apply(Op.SNAPSHOT, NS, 2, hs[:10]) == 10
    assert ix.holders(NS, hs[:1]) == [{1, 2}]
    assert ix.apply(Op.EVICT, NS, 1, hs[:20]) == 20
    assert ix.apply(Op.EVICT, NS, 1, hs[:20]) == 0
    assert ix.holders(NS, [hs[0], hs[15], hs[30]]) == [{2}, set(), {1}]


def test_replaying_a_suffix_of_events_in_order_changes_nothing(r: fakeredis.FakeRedis) -> None:
    rng = random.Random(1)
    pool = hashes(40, seed=2)
    events = [(rng.choice([Op.INSERT, Op.EVICT]), rng.sample(pool, 8)) for _ in range(60)]
    ix = Index(r)
    for op, hs in events:
        ix.apply(op, NS, 5, hs)
    before = ix.holders(NS, pool)
    assert any(before) and not all(before)
    for op, hs in events[25:]:  # a crashed consumer's unacked tail, applied again
        ix.apply(op, NS, 5, hs)
    assert ix.holders(NS, pool) == before


def test_query_returns_each_nodes_prefix_length(r: fakeredis.FakeRedis) -> None:
    ix = Index(r)
    hs = hashes(128)
    ix.apply(Op.INSERT, NS, 1, hs)  # all 128
    ix.apply(Op.INSERT, NS, 2, hs[:40])  # 40
    ix.apply(Op.INSERT, NS, 3, hs[:5] + hs[6:100])  # hole at 5
    ix.apply(Op.INSERT, NS, 4, hs[1:])  # lacks block 0: no prefix
    ix.apply(Op.INSERT, "other-namespace", 5, hs)  # other namespace never seen
    assert ix.query(NS, hs) == {1: 128, 2: 40, 3: 5}
    assert ix.query(NS, [hashes(1, seed=9)[0]]) == {}


# --- registry --------------------------------------------------------------------------------


def test_register_switch_and_heartbeat(r: fakeredis.FakeRedis) -> None:
    nid1, e1 = registry.register(r, "a", "h:1", 10_000, switch=True)
    assert nid1 > 1 << 20 and e1 >= 1  # random bases in a fresh Redis
    assert registry.visible(r, ["a"]) == {nid1: "a"}
    # In-process re-sync: the old epoch stays visible until the snapshot is applied.
    nid2, e2 = registry.register(r, "a", "h:1", 10_000, switch=False)
    assert (nid2, e2) == (nid1 + 1, e1 + 1) and registry.visible(r, ["a"]) == {nid1: "a"}
    assert registry.heartbeat(r, "a", nid2, 10_000)
    assert not registry.heartbeat(r, "a", nid1, 10_000)  # superseded incarnation
    assert registry.switch(r, "a", nid2) == 2
    assert registry.visible(r, ["a"]) == {nid2: "a"} and nid1 in registry.retired(r)
    # Restart: the new incarnation is visible at once.
    nid3, _ = registry.register(r, "a", "h:1", 10_000, switch=True)
    assert registry.visible(r, ["a"]) == {nid3: "a"} and registry.switch(r, "a", nid2) == 0
    # Liveness gone: invisible; a heartbeat before the node is reaped brings the same nid back.
    r.delete(keys.live_key("a"))
    assert registry.visible(r, ["a"]) == {}
    assert registry.reap(r, ["a"], idle_ms=60_000) == []  # heartbeat just now: not silent long enough
    assert registry.heartbeat(r, "a", nid3, 10_000)
    assert registry.visible(r, ["a"]) == {nid3: "a"}
    # Reaped (silent long enough): retired and forgotten; its heartbeat now fails (re-register).
    r.delete(keys.live_key("a"))
    assert registry.reap(r, ["a"]) == ["a"] and nid3 in registry.retired(r) and registry.nodes(r) == {}
    assert not registry.heartbeat(r, "a", nid3, 10_000)


def test_a_rival_is_another_live_node_at_another_address_that_took_the_name(r: fakeredis.FakeRedis) -> None:
    mine, _ = registry.register(r, "a", "h:1", 10_000, switch=True)
    assert registry.rival(r, "a", mine, "h:1") is None  # the name is ours
    theirs, _ = registry.register(r, "a", "h:2", 10_000, switch=True)
    got = registry.rival(r, "a", mine, "h:1")
    assert got is not None and (got.nid, got.addr) == (theirs, "h:2")
    assert registry.rival(r, "a", mine, "h:2") is None  # the same address: this node restarted
    r.delete(keys.live_key("a"))
    assert registry.rival(r, "a", mine, "h:1") is None  # the other one is dead: free to register


def test_a_node_that_leaves_hides_only_its_own_incarnation(r: fakeredis.FakeRedis) -> None:
    old, _ = registry.register(r, "a", "h:1", 10_000, switch=True)
    nid, _ = registry.register(r, "a", "h:2", 10_000, switch=False)  # re-syncing: ``old`` still visible
    v = registry.version(r)
    assert not registry.leave(r, "a", old)  # superseded: not its to hide
    assert registry.visible(r, ["a"]) == {old: "a"} and registry.version(r) == v
    assert registry.leave(r, "a", nid)  # the visible one is its re-sync's: hidden all the same
    assert registry.visible(r, ["a"]) == {} and registry.version(r) == v + 1
    assert not registry.leave(r, "a", nid)  # nothing left to hide
    assert registry.nodes(r)["a"].nid == nid  # still registered


@pytest.mark.parametrize("ending", ["switch", "reap", "register", "heartbeat"])
def test_the_incarnation_visible_during_a_re_sync_is_retired_however_the_re_sync_ends(
        r: fakeredis.FakeRedis, ending: str) -> None:
    """A node re-syncs in process: its new incarnation registers unswitched while the old one
    stays visible. If the node's liveness lapses before the switch, the old one was never
    retired: never swept, and counted as an owner of its blocks for good."""
    nid1, _ = registry.register(r, "a", "h:1", 10_000, switch=True)
    nid2, _ = registry.register(r, "a", "h:1", 10_000, switch=False)
    assert registry.visible(r, ["a"]) == {nid1: "a"} and nid1 not in registry.retired(r)
    if ending == "switch":
        assert registry.switch(r, "a", nid2) == 2
        assert registry.visible(r, ["a"]) == {nid2: "a"}
    else:
        r.delete(keys.live_key("a"))  # the node stalled past its --liveness-ttl
        if ending == "reap":
            assert registry.reap(r, ["a"]) == ["a"] and nid2 in registry.retired(r)
        elif ending == "register":  # it restarted
            nid3, _ = registry.register(r, "a", "h:1", 10_000, switch=True)
            assert registry.visible(r, ["a"]) == {nid3: "a"} and nid2 in registry.retired(r)
        else:  # it beats again, its new incarnation's liveness now; the switch finds it visible
            assert registry.heartbeat(r, "a", nid2, 10_000)
            assert registry.visible(r, ["a"]) == {nid2: "a"} and registry.switch(r, "a", nid2) == 1
    assert nid1 in registry.retired(r), "the re-sync's old incarnation was never retired"
    assert all("prev" not in json.loads(v) for v in r.hvals(keys.NODES)), "a superseded incarnation still kept"


# --- publisher buffer and consumer on fakeredis ------------------------------------------------


def test_full_buffer_drops_counts_and_never_blocks() -> None:
    pub = EventPublisher(fakeredis.FakeRedis(), "n", "h:1", lambda: [], buffer_blocks=100)  # never started
    pub.on_insert(NS, hashes(60))
    pub.on_insert(NS, hashes(60, seed=1))  # does not fit: dropped
    pub.on_insert(NS, hashes(1, seed=2))  # dropping until the re-sync cut
    assert pub.stats.dropped_blocks == 61 and pub._buf_blocks == 60


def test_one_drop_episode_re_syncs_once_while_the_loop_keeps_changing_the_index(r: fakeredis.FakeRedis) -> None:
    """An update handled on the loop between the re-sync's start and its cut goes into the
    buffer the cut discards (the snapshot has it): it is not dropped, so no second re-sync."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    pub = EventPublisher(r, "n1", "h:1", lambda: [], loop=loop, buffer_blocks=100, flush_interval=0.5)
    try:
        pub.start(wait=5)
        assert pub.stats.resyncs == 1
        take = pub._take_snapshot

        async def an_insert() -> None:
            pub.on_insert(NS, hashes(1, seed=8))

        def busy_take() -> list:  # the loop handles an insert before it runs the cut
            asyncio.run_coroutine_threadsafe(an_insert(), loop).result(5)
            return take()

        pub._take_snapshot = busy_take  # type: ignore[method-assign]
        pub.on_insert(NS, hashes(60))
        pub.on_insert(NS, hashes(60, seed=1))  # overflows: dropping until the re-sync's cut
        assert pub.stats.dropped_blocks == 60
        wait_until(lambda: pub.stats.resyncs >= 2 and pub.wait_idle(0.1), 10, "the re-sync")
        assert pub.stats.resyncs == 2 and pub.stats.dropped_blocks == 60
    finally:
        pub.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_publisher_and_consumer_converge_and_skip_malformed(r: fakeredis.FakeRedis) -> None:
    state: dict[str, set[bytes]] = {NS: set(hashes(20, seed=3))}
    pub = EventPublisher(
        r, "n1", "h:1", lambda: [(ns, sorted(h)) for ns, h in state.items()], flush_interval=0.001
    )
    pub.start(wait=5)
    new = hashes(30, seed=4)
    state[NS].update(new)
    pub.on_insert(NS, new)
    gone = sorted(state[NS])[:7]
    state[NS].difference_update(gone)
    pub.on_evict(NS, gone)
    assert pub.wait_idle(5)
    r.xadd(stream_key("n1"), {FIELD: b"\x01garbage"})
    r.xadd(stream_key("n1"), {b"other": b"x"})
    r.xadd(
        stream_key("n1"), {FIELD: encode(Event.make("intruder", pub.nid, 1, 99, Op.INSERT, NS, hashes(1, 9)))}
    )
    last = hashes(3, seed=5)
    state[NS].update(last)
    pub.on_insert(NS, last)
    assert pub.wait_idle(5)
    c = Consumer(r, Index(r), "c1")
    assert c.wait_caught_up(10)
    assert c.stats.malformed == 3
    (live,) = registry.visible(r, ["n1"])
    every = sorted(set(hashes(20, seed=3)) | set(new) | set(last) | set(hashes(1, 9)))
    got = {h for h, nids in zip(every, Index(r).holders(NS, every), strict=True) if live in nids}
    assert got == state[NS]
    assert r.xpending(stream_key("n1"), "pf-meta")["pending"] == 0
    pub.stop()


def test_query_never_matches_a_nid_across_two_others(r: fakeredis.FakeRedis) -> None:
    # 0x00000100 then 0x02000000 stored side by side contain the bytes of 0x00010002 at offset 2.
    ix = Index(r)
    hs = hashes(2, seed=11)
    for nid in (0x00010002, 0x00000100, 0x02000000):
        ix.apply(Op.INSERT, NS, nid, hs[:1])
    for nid in (0x00000100, 0x02000000):
        ix.apply(Op.INSERT, NS, nid, hs[1:])
    assert ix.query(NS, hs) == {0x00010002: 1, 0x00000100: 2, 0x02000000: 2}


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--addr", "nowhere"], "invalid address"),
        (["--redis-url", "http://127.0.0.1:6379"], "invalid Redis URL"),
        (["rebuild", "--query-max-blocks", "0"], "must be > 0"),
    ],
)
def test_meta_cli_rejects_bad_options_in_one_line(argv: list[str], needle: str, capsys, monkeypatch) -> None:
    from pegaflow.meta.cli import main

    monkeypatch.delenv("PEGAFLOW_REDIS_URL", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and err.count("\n") == 1


def test_redis_url_option_is_validated_for_node_and_meta() -> None:
    from pegaflow.config.commands import load
    from pegaflow.config.options import META, NODE

    assert load(META, "m", ["--redis-url", "redis://h:1/0"], env={}).redis_url == ("redis://h:1/0",)
    assert load(NODE, "n", [], env={}).redis_url == ()
    for cmd in (META, NODE):
        with pytest.raises(SystemExit):
            load(cmd, "x", ["--redis-url", "localhost:6379"], env={})


def test_a_redis_that_lost_its_data_never_reuses_an_incarnation(r: fakeredis.FakeRedis) -> None:
    # Node a is nid X before the loss; after it, b registers first. With a counter that
    # restarts at 1, b got a's old nid, and a's events written before it noticed the loss
    # were indexed as b's blocks (found by the chaos suite: 27 extra blocks, 120 wrong holders).
    before = {registry.register(r, n, "h:1", 10_000, switch=True) for n in ("a", "b")}
    r.flushall()
    after = {registry.register(r, n, "h:1", 10_000, switch=True) for n in ("b", "a")}
    assert not {nid for nid, _ in before} & {nid for nid, _ in after}


def test_consumer_drops_events_of_an_incarnation_that_is_not_the_newest(r: fakeredis.FakeRedis) -> None:
    from pegaflow.cluster.keys import stream_key
    from pegaflow.meta.events.codec import FIELD, encode
    from pegaflow.meta.events.consumer import Consumer
    from pegaflow.meta.events.schema import Event

    old_nid, old_epoch = registry.register(r, "a", "h:1", 10_000, switch=True)
    r.flushall()  # Redis lost everything; "a" has not noticed yet and keeps writing
    nid_b, epoch_b = registry.register(r, "b", "h:2", 10_000, switch=True)
    stale = hashes(4, seed=3)
    r.xadd(stream_key("a"), {FIELD: encode(Event("a", old_nid, old_epoch, 7, Op.INSERT, NS, b"".join(stale)))})
    # Even an event that names b's new nid with a's old epoch is not b's.
    r.xadd(stream_key("a"), {FIELD: encode(Event("a", nid_b, old_epoch, 8, Op.INSERT, NS, b"".join(stale)))})
    fresh = hashes(4, seed=4)
    r.xadd(stream_key("b"), {FIELD: encode(Event("b", nid_b, epoch_b, 0, Op.INSERT, NS, b"".join(fresh)))})
    # Then "a" notices and registers again; its stream is read from the start.
    nid_a, epoch_a = registry.register(r, "a", "h:1", 10_000, switch=True)
    mine = hashes(4, seed=5)
    r.xadd(stream_key("a"), {FIELD: encode(Event("a", nid_a, epoch_a, 0, Op.INSERT, NS, b"".join(mine)))})
    c = Consumer(r, Index(r), "c1", lease_ms=10_000)
    for _ in range(5):
        c.step()
    ix = Index(r)
    assert ix.query(NS, fresh) == {nid_b: 4}
    assert ix.query(NS, mine) == {nid_a: 4}
    assert ix.query(NS, stale) == {}, "events of a lost incarnation were indexed"
    assert c.stats.stale == 2


def test_consumer_applies_in_bounded_rounds_so_queries_interleave(r: fakeredis.FakeRedis, monkeypatch) -> None:
    """One step's script calls reach Redis in round trips of at most APPLY_ROUND_BLOCKS
    updates (one pipeline of a whole step held Redis for ~0.4 s, and every QueryPrefix
    behind it), in order, and the index ends up the same. (fakeredis has no socket, so
    every update takes the script path here.)"""
    from pegaflow.meta import index

    nid, epoch = registry.register(r, "n1", "h:1", 60_000, switch=True)
    r.xgroup_create(stream_key("n1"), "pf-meta", id="0", mkstream=True)
    batches = [hashes(index.APPLY_ROUND_BLOCKS // 2, seed=100 + i) for i in range(9)]
    for seq, hs in enumerate(batches, 1):
        r.xadd(stream_key("n1"), {FIELD: encode(Event.make("n1", nid, epoch, seq, Op.INSERT, NS, hs))})
    rounds: list[int] = []
    real = index.run_scripts

    def counting(client, calls):  # type: ignore[no-untyped-def]
        rounds.append(sum(len(c[2][3]) // 16 for c in calls))  # ARGV[4]: the hashes
        return real(client, calls)

    monkeypatch.setattr(index, "run_scripts", counting)
    c = Consumer(r, Index(r), "c1")
    assert c.wait_caught_up(10)
    assert sum(rounds) == sum(len(b) for b in batches)
    assert len(rounds) >= 4 and max(rounds) <= index.APPLY_ROUND_BLOCKS
    every = [h for b in batches for h in b]
    assert all(nids for nids in Index(r).holders(NS, every))


def test_prefix_holders_equals_a_block_by_block_reading() -> None:
    """``index.prefix_holders`` (the HGET batch's answer) against the definition: each nid
    holding block 0 and the number of leading blocks it holds, on random holder lists
    (aligned 4-byte nids, so a match across two nids must not count)."""
    import random

    from pegaflow.meta.index import nid_bytes, prefix_holders

    rng = random.Random(5)

    def definition(values):  # type: ignore[no-untyped-def]
        if not values or values[0] is None:
            return {}
        out = {}
        for nid in {int.from_bytes(values[0][j:j + 4], "big") for j in range(0, len(values[0]), 4)}:
            n = 0
            while n < len(values) and values[n] is not None and any(
                    values[n][j:j + 4] == nid_bytes(nid) for j in range(0, len(values[n]), 4)):
                n += 1
            out[nid] = n
        return out

    # nids whose bytes straddle: 0x00000100 + 0x00020000 contains 0x01000002 across them
    nids = [1, 2, 3, 0x00000100, 0x00020000, 0x01000002]
    for _ in range(3000):
        n = rng.randint(0, 12)
        base = rng.sample(nids, rng.randint(1, 3))
        values = []
        for _i in range(n):
            r = rng.random()
            if r < 0.08:
                values.append(None)
                continue
            if r < 0.3:
                base = [x for x in base if rng.random() < 0.7] or rng.sample(nids, 1)
            values.append(b"".join(nid_bytes(x) for x in rng.sample(base, len(base))))
        assert prefix_holders(values) == definition(values), values


def test_hand_packed_index_commands_are_the_bytes_redis_py_would_send() -> None:
    import os

    from redis.connection import Connection

    from pegaflow.meta import index as index_mod

    conn = Connection()
    tag = "00ff00ff00ff00ff"
    blob, prefix, nid = os.urandom(HASH_BYTES * 5), keys.bucket_prefix(tag), index_mod.nid_bytes(7)
    hs = [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]
    assert index_mod._hsetnx_batch(prefix, blob, nid) == b"".join(
        b"".join(conn.pack_command("HSETNX", keys.bucket_key(tag, h), keys.field(h), nid)) for h in hs)
    assert index_mod._hget_batch(prefix, blob) == b"".join(
        b"".join(conn.pack_command("HGET", keys.bucket_key(tag, h), keys.field(h))) for h in hs)


def test_the_incarnation_still_visible_during_a_re_sync_keeps_its_events_applied(r: fakeredis.FakeRedis) -> None:
    """Until the new incarnation switches, readers see the old one: its evictions written
    before the node's new RESET must reach the Redis index too (lookups answered from Redis
    named a node for blocks it had evicted, unlike the view)."""
    nid1, e1 = registry.register(r, "a", "h:1", 10_000, switch=True)
    x = hashes(4, seed=6)
    publish(r, Event("a", nid1, e1, 0, Op.INSERT, NS, b"".join(x)))
    c = Consumer(r, Index(r), "c1", lease_ms=10_000)
    steps(c)
    assert Index(r).query(NS, x) == {nid1: 4}
    publish(r, Event("a", nid1, e1, 1, Op.EVICT, NS, b"".join(x[2:])))
    registry.register(r, "a", "h:1", 10_000, switch=False)  # an in-process re-sync starts
    steps(c)
    assert registry.visible(r, ["a"]) == {nid1: "a"}
    assert Index(r).query(NS, x) == {nid1: 2}, "the visible incarnation's eviction was dropped"
    assert c.stats.stale == 0


def test_two_replicas_on_one_host_with_one_pid_get_their_own_consumer_names(monkeypatch) -> None:
    """Host networking: one hostname, and PID 1 in each replica's container."""
    import os

    from pegaflow.meta.events import consumer

    monkeypatch.setattr(os, "getpid", lambda: 1)
    names = {consumer.default_consumer_name() for _ in range(8)}
    assert len(names) == 8 and all(n.startswith(f"{consumer.socket.gethostname()}-1-") for n in names)


def test_a_replica_whose_lease_lapsed_while_it_claimed_reads_nothing_more_of_that_stream(
        r: fakeredis.FakeRedis, monkeypatch) -> None:
    """Claiming a taken-over stream's entries can take long; another replica may take one of
    this replica's streams meanwhile. What this one read of it then would stay in its own
    pending list, which the new owner (reading only new entries) never looks at."""
    from types import SimpleNamespace

    from pegaflow.cluster.keys import owner_key, stream_key
    from pegaflow.meta.events import consumer as consumer_mod
    from pegaflow.meta.events.codec import FIELD, encode
    from pegaflow.meta.events.schema import Event
    from pegaflow.meta.events.streams import GROUP

    clock = [1000.0]
    monkeypatch.setattr(consumer_mod, "time", SimpleNamespace(monotonic=lambda: clock[0], time=lambda: clock[0]))
    nid_a, e_a = registry.register(r, "a", "h:1", 10_000, switch=True)
    registry.register(r, "b", "h:2", 10_000, switch=True)
    c = consumer_mod.Consumer(r, Index(r), "c1", lease_ms=10_000)
    c.step()
    assert set(c.streams) == {"a", "b"}
    r.xadd(stream_key("a"), {FIELD: encode(Event("a", nid_a, e_a, 0, Op.INSERT, NS, b"".join(hashes(2))))})
    c.streams["b"].claimed = False  # b is claimed again in the next step, slowly:
    real = c._claim

    def slow_claim(st):  # type: ignore[no-untyped-def]
        clock[0] += 11.0  # past the lease
        r.set(owner_key("a"), "c2")  # another replica took stream a meanwhile
        return real(st)

    monkeypatch.setattr(c, "_claim", slow_claim)
    c.step()
    assert "a" not in c.streams
    assert r.xpending(stream_key("a"), GROUP)["pending"] == 0, "entries stranded in the old owner's list"


def test_a_reaped_node_leaves_no_decode_backup_report(r: fakeredis.FakeRedis) -> None:
    """Node ids change with pod names: a report kept for each reaped node grew the hash the
    backup planner reads whole every second, for good."""
    from pegaflow.cluster import backup

    registry.register(r, "a", "h:1", 10_000, switch=True)
    registry.register(r, "b", "h:2", 10_000, switch=True)
    for n in ("a", "b"):
        backup.report(r, n, False, 1 << 20)
    r.delete(keys.live_key("a"))
    assert registry.reap(r, ["a", "b"]) == ["a"]
    assert not r.hexists(keys.BACKUP_REPORTS, "a") and r.hexists(keys.BACKUP_REPORTS, "b")


def test_a_compaction_whose_reset_another_consumer_read_still_trims_the_old_epoch(r: fakeredis.FakeRedis) -> None:
    """The stream changed hands (or the consumer process restarted) between a re-sync's RESET
    and its LAST: the older epochs stayed in the stream (another snapshot's worth each time,
    read again by every view start-over and rebuild)."""
    from pegaflow.meta.events.codec import decode_entry

    nid1, e1 = registry.register(r, "a", "h:1", 10_000, switch=True)
    publish(r, Event("a", nid1, e1, 0, Op.RESET))
    publish(r, Event("a", nid1, e1, 1, Op.SNAPSHOT, NS, b"".join(hashes(2, seed=1)), FLAG_LAST))
    publish(r, Event("a", nid1, e1, 2, Op.INSERT, NS, b"".join(hashes(2, seed=2))))
    steps(Consumer(r, Index(r), "c1", lease_ms=10_000))
    nid2, e2 = registry.register(r, "a", "h:1", 10_000, switch=False)  # compaction: a new epoch
    publish(r, Event("a", nid2, e2, 0, Op.RESET))
    publish(r, Event("a", nid2, e2, 1, Op.SNAPSHOT, NS, b"".join(hashes(4, seed=3))))
    steps(Consumer(r, Index(r), "c1", lease_ms=10_000))
    publish(r, Event("a", nid2, e2, 2, Op.SNAPSHOT, NS, b"".join(hashes(4, seed=4)), FLAG_LAST))
    steps(Consumer(r, Index(r), "c1", lease_ms=10_000))  # a new consumer object: the RESET was another's
    assert registry.visible(r, ["a"]) == {nid2: "a"}
    assert {decode_entry(f).epoch for _, f in r.xrange(stream_key("a"))} == {e2}, "the old epoch was not trimmed"


def test_a_replica_that_takes_a_stream_over_drops_the_gone_replicas_consumer(r: fakeredis.FakeRedis) -> None:
    """Every replica restart is a new consumer name; the group kept each one for good."""
    from pegaflow.cluster.keys import owner_key, stream_key
    from pegaflow.meta.events.codec import FIELD, encode
    from pegaflow.meta.events.consumer import Consumer
    from pegaflow.meta.events.schema import Event
    from pegaflow.meta.events.streams import GROUP

    nid, epoch = registry.register(r, "a", "h:1", 10_000, switch=True)
    r.xadd(stream_key("a"), {FIELD: encode(Event("a", nid, epoch, 0, Op.INSERT, NS, b"".join(hashes(2))))})
    old = Consumer(r, Index(r), "old-replica", lease_ms=10_000)
    old.step()
    r.delete(owner_key("a"))  # the old replica is gone: its lease and its heartbeat lapse
    r.zrem(keys.CONSUMERS, "old-replica")
    new = Consumer(r, Index(r), "new-replica", lease_ms=10_000)
    new.step()
    assert [c["name"] for c in r.xinfo_consumers(stream_key("a"), GROUP)] == [b"new-replica"]
