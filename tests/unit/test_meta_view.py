"""The metaserver's in-memory prefix view (pegaflow/meta/view.py over pegaflow/native/metaview.c):
held equal to the dict reference (tests/oracles/meta_view.py) operation by operation, through
growth, evictions, tier changes and cleared slots; its walk equal to what the Redis index
(pegaflow/meta/index.py, on a real redis-server) answers for the same events; bad input
refused before anything changes."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.cluster import keys
from pegaflow.core.tiers import Tier
from pegaflow.meta.events.schema import Op, Update
from pegaflow.meta.index import Index, nid_bytes, prefix_tiers
from pegaflow.meta.view import ALL_SLOTS, MAX_SLOTS, PrefixView
from tests.harness.redis import RedisServer, start_server
from tests.oracles.meta_view import DictView

_rng = random.Random(7)
# Uniform hashes, plus structured ones (runs of one byte, counters) that a weak mix would pile up.
POOL = ([_rng.randbytes(16) for _ in range(2400)] + [bytes([i]) * 16 for i in range(1, 256)]
        + [i.to_bytes(16, "little") for i in range(1, 400)])
SLOTS = [0, 1, 2, 5, 31, 32, 63]
NAMESPACES = 3
LOAD = 0.7


def blob_or_list(hs: list[bytes], as_list: bool) -> bytes | list[bytes]:
    return hs if as_list else b"".join(hs)


def check_walks(view: PrefixView, ref: DictView, rng: random.Random, n: int = 6) -> None:
    """Walks over chains of the pool (how the ops insert them), shuffled prefixes and masks."""
    for _ in range(n):
        ns = rng.randrange(NAMESPACES)
        start = rng.randrange(len(POOL))
        hs = POOL[start : start + rng.choice([1, 2, 17, 128, 300])]
        if rng.random() < 0.2:
            hs = hs[:1] + rng.sample(POOL, 5)
        mask = rng.choice([ALL_SLOTS, 0, 1, 1 << 63, rng.getrandbits(64)])
        got = view.walk(ns, blob_or_list(hs, rng.random() < 0.5), mask)
        assert got == ref.walk(ns, hs, mask), (ns, mask)


def check_state(view: PrefixView, ref: DictView) -> None:
    assert len(view) == len(ref)
    for ns in range(NAMESPACES):
        assert view.dump(ns) == ref.dump(ns)
        slots = view.index_slots(ns)
        assert slots == 0 or len(ref.dump(ns)) <= LOAD * slots


# --- against the dict reference ---------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(0, NAMESPACES - 1), st.sampled_from(SLOTS), st.booleans(),
                  st.booleans(), st.integers(0, len(POOL) - 1), st.integers(0, 700), st.booleans()),
        st.tuples(st.just("clear"), st.sampled_from(SLOTS)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(OPS, st.integers(0, 2**64 - 1))
def test_view_equals_the_dict_reference_under_random_operations(ops: list[tuple], seed: int) -> None:
    view, ref = PrefixView(seed), DictView()
    rng = random.Random(seed)
    for op in ops:
        if op[0] == "clear":
            assert view.clear_slot(op[1]) == ref.clear_slot(op[1])
        else:
            _, ns, slot, add, ssd, start, n, as_list = op
            hs = POOL[start : start + n]
            if n % 7 == 3:  # repeats within one entry: only the first changes anything
                hs = hs + hs[: n // 2]
            assert view.update(ns, slot, add, ssd, blob_or_list(hs, as_list)) == ref.update(ns, slot, add, ssd, hs)
        assert len(view) == len(ref)
        check_walks(view, ref, rng, 2)
    check_state(view, ref)
    check_walks(view, ref, rng, 20)


def test_a_long_run_with_growth_tier_changes_evictions_and_resets_equals_the_reference() -> None:
    rng = random.Random(3)
    pool = [rng.randbytes(16) for _ in range(60_000)]
    view, ref = PrefixView(), DictView()
    grown = 0
    for step in range(900):
        r = rng.random()
        ns = rng.randrange(NAMESPACES)
        slot = rng.choice(SLOTS)
        start = rng.randrange(len(pool))
        hs = pool[start : start + rng.randint(1, 512)]
        if r < 0.55:
            before = view.index_slots(ns)
            ssd = rng.random() < 0.3
            assert view.apply(ns, slot, Op.INSERT, hs, Tier.SSD if ssd else Tier.L1) == ref.update(ns, slot, True, ssd, hs)
            grown += before != 0 and view.index_slots(ns) > before
        elif r < 0.9:
            assert view.apply(ns, slot, Op.EVICT, b"".join(hs)) == ref.update(ns, slot, False, False, hs)
        elif r < 0.98:  # a tier change of what the slot holds: DRAM -> SSD or back
            ssd = rng.random() < 0.5
            assert view.apply(ns, slot, Op.SNAPSHOT, hs, Tier.SSD if ssd else Tier.L1) == ref.update(ns, slot, True,
                                                                                                      ssd, hs)
        else:
            assert view.clear_slot(slot) == ref.clear_slot(slot)
        if step % 100 == 0:
            check_state(view, ref)
        check_walks(view, ref, rng, 1)
    check_state(view, ref)
    assert grown >= 3, "the run must make the tables grow"
    for slot in SLOTS:
        assert view.clear_slot(slot) == ref.clear_slot(slot)
    assert len(view) == 0 and all(view.index_slots(ns) == 0 for ns in range(NAMESPACES))
    assert view.nbytes < 4096, "an empty view gives its tables back"


def test_a_slot_cleared_in_steps_between_other_slots_updates_equals_clearing_it_at_once() -> None:
    """clear_slot_part: small budgets, tables emptied and grown between steps, evictions that
    move entries into holes below the cursor; in the end what clear_slot leaves."""
    rng = random.Random(11)
    pool = [rng.randbytes(16) for _ in range(20_000)]
    for trial in range(12):
        view, ref = PrefixView(trial), DictView()
        dying = rng.choice(SLOTS)
        others = [s for s in SLOTS if s != dying]
        for _ in range(60):
            ns, start = rng.randrange(NAMESPACES), rng.randrange(len(pool))
            hs = pool[start : start + rng.randint(1, 700)]
            slot, ssd = rng.choice(SLOTS), rng.random() < 0.3
            assert view.update(ns, slot, True, ssd, hs) == ref.update(ns, slot, True, ssd, hs)
        expect = ref.clear_slot(dying)
        cursor, removed, steps = 0, 0, 0
        while True:
            got, cursor = view.clear_slot_part(dying, cursor, rng.choice([1, 7, 100, 5000]))
            removed += got
            steps += 1
            if cursor == 0:
                break
            # Other slots go on between steps: adds, evictions (holes filled from the end), a namespace emptied.
            ns, start = rng.randrange(NAMESPACES), rng.randrange(len(pool))
            hs = pool[start : start + rng.randint(1, 300)]
            slot = rng.choice(others)
            r = rng.random()
            if r < 0.4:
                assert view.update(ns, slot, True, False, hs) == ref.update(ns, slot, True, False, hs)
            elif r < 0.9:
                assert view.update(ns, slot, False, False, hs) == ref.update(ns, slot, False, False, hs)
            else:
                for s in others:
                    assert view.update(ns, s, False, False, pool) == ref.update(ns, s, False, False, pool)
        assert removed == expect and steps > 1
        check_state(view, ref)
        assert all(not (l1 | ssd) >> dying & 1 for ns in range(NAMESPACES) for l1, ssd in view.dump(ns).values())
    with pytest.raises(ValueError):
        PrefixView().clear_slot_part(0, 0, 0)
    with pytest.raises(ValueError):
        PrefixView().clear_slot_part(MAX_SLOTS, 0, 10)


def test_growth_doubles_the_index_before_load_passes_0_7_and_loses_nothing() -> None:
    rng = random.Random(5)
    view, ref = PrefixView(), DictView()
    sizes: list[int] = []
    for _ in range(200):
        hs = [rng.randbytes(16) for _ in range(512)]
        view.update(0, 7, True, False, b"".join(hs))
        ref.update(0, 7, True, False, hs)
        slots = view.index_slots(0)
        assert len(view) <= LOAD * slots
        if not sizes or sizes[-1] != slots:
            sizes.append(slots)
    assert sizes == [1024 << k for k in range(len(sizes))] and sizes[-1] >= 1 << 17
    assert view.dump(0) == ref.dump(0)
    # Memory: 32 B per entry, 4 B per index slot at load 0.35..0.7, entries' slack <= 1/8.
    assert view.nbytes / len(view) <= 48


def test_oracle_walk_equals_prefix_tiers_of_the_same_holder_lists() -> None:
    """The reference's walk is index.prefix_tiers (what QueryPrefix answers from Redis) on the
    holder lists Redis would hold, nid = slot."""
    rng = random.Random(11)
    hs = [rng.randbytes(16) for _ in range(40)]
    for _ in range(400):
        ref = DictView()
        for _ in range(rng.randint(1, 8)):
            a = rng.randrange(len(hs))
            ref.update(0, rng.choice(SLOTS), rng.random() < 0.8, rng.random() < 0.4, hs[a : a + rng.randint(1, 40)])
        start = rng.randrange(4)
        q = hs[start : start + rng.randint(1, 30)]
        lists: list[bytes | None] = []
        for h in q:
            l1, s = ref.holders(0, h)
            lists.append(b"".join(nid_bytes(k, Tier.SSD if s >> k & 1 else Tier.L1) for k in range(MAX_SLOTS)
                                  if (l1 | s) >> k & 1) or None)
        want = {nid: (h.prefix_len, h.ssd_blocks) for nid, h in prefix_tiers(lists).items()}
        assert {slot: (n, s) for slot, n, s in ref.walk(0, q, ALL_SLOTS)} == want


# --- against the Redis index ----------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    srv = start_server(tmp_path / "redis")
    try:
        yield srv
    finally:
        srv.stop()


def test_walk_equals_what_the_redis_index_answers_for_the_same_events(redis_server: RedisServer) -> None:
    r = redis.Redis(port=redis_server.port)
    index = Index(r)
    index.ensure_scripts()
    names = [f"view-test-{k}|fp16|bs16|tp1" for k in range(NAMESPACES)]
    nid_of = {slot: 1000 + 17 * slot for slot in SLOTS}  # nids are the registry's; slots the view's
    rng = random.Random(13)
    pool = POOL[:2000]
    view = PrefixView()

    def compare() -> None:
        for _ in range(12):
            ns = rng.randrange(NAMESPACES)
            start = rng.randrange(len(pool))
            q = pool[start : start + rng.choice([1, 5, 64, 128])]
            want = index.query_tiers(names[ns], q)  # the HGET batch: what QueryPrefix reads
            assert {nid_of[slot]: h for slot, h in view.held(ns, q).items()} == want

    for step in range(160):
        ns = rng.randrange(NAMESPACES)
        slot = rng.choice(SLOTS)
        r_ = rng.random()
        if r_ < 0.03:
            dead = nid_of[slot]
            assert view.clear_slot(slot) == index.sweep([keys.ns_tag(n) for n in names], [dead])
            continue
        start = rng.randrange(len(pool))
        hs = pool[start : start + rng.randint(1, 300)]
        op = Op.EVICT if r_ < 0.35 else rng.choice([Op.INSERT, Op.SNAPSHOT])
        tier = rng.choice([Tier.L1, Tier.SSD]) if op != Op.EVICT else Tier.L1
        blob = b"".join(hs)
        changed = index.apply_many([Update(op, names[ns], nid_of[slot], blob, tier)])
        assert view.apply(ns, slot, op, blob, tier) == changed, step
        if step % 10 == 0:
            compare()
    compare()
    dump = index.dump([keys.ns_tag(n) for n in names])
    assert len(view) == len(dump)
    slot_of = {nid: slot for slot, nid in nid_of.items()}
    for ns, name in enumerate(names):
        tag = keys.ns_tag(name)
        got = {h: (l1 | s) for h, (l1, s) in view.dump(ns).items()}
        assert got == {h: sum(1 << slot_of[n] for n in nids) for (t, h), nids in dump.items() if t == tag}


# --- bad input --------------------------------------------------------------------------------


def test_bad_input_raises_value_error_and_changes_nothing() -> None:
    view = PrefixView()
    view.apply(0, 1, Op.INSERT, POOL[:4])
    before = view.dump(0)
    cases = [
        (lambda: view.apply(0, 1, Op.INSERT, b"x" * 17), "17 bytes is not a multiple of 16"),
        (lambda: view.walk(0, b"x" * 33, ALL_SLOTS), "33 bytes is not a multiple of 16"),
        (lambda: view.apply(0, 1, Op.INSERT, [POOL[5], b"short"]), "hash 1 has 5 bytes, expected 16"),
        (lambda: view.apply(0, 64, Op.INSERT, POOL[5]), "node slot 64 out of range"),
        (lambda: view.apply(0, -1, Op.EVICT, POOL[0]), "node slot -1 out of range"),
        (lambda: view.clear_slot(64), "node slot 64 out of range"),
        (lambda: view.apply(65536, 1, Op.INSERT, POOL[5]), "namespace id 65536 out of range"),
        (lambda: view.walk(0, POOL[:2], -1), "live_mask must be in 0..2**64 - 1"),
        (lambda: view.walk(0, POOL[:2], 1 << 64), "live_mask must be in 0..2**64 - 1"),
        (lambda: view.apply(0, 1, Op.RESET, b""), "RESET changes no block"),
        (lambda: view.apply(0, 1, Op.INSERT, POOL[5], Tier.REMOTE), "not remote"),
        (lambda: view.holders(0, POOL[0] + POOL[1]), "one hash of 16 bytes"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            call()
    with pytest.raises(TypeError, match="hash 0 is str"):
        view.walk(0, ["a" * 16], ALL_SLOTS)  # type: ignore[list-item]
    assert view.dump(0) == before and len(view) == 4


def test_apply_counts_tier_changes_and_walk_counts_ssd_blocks_inside_the_prefix() -> None:
    view = PrefixView()
    chain = POOL[:8]
    assert view.apply(2, 3, Op.INSERT, chain) == 8
    assert view.apply(2, 3, Op.INSERT, chain) == 0  # a replay changes nothing
    assert view.apply(2, 3, Op.INSERT, chain[2:5], Tier.SSD) == 3  # left DRAM for the SSD
    assert view.apply(2, 9, Op.SNAPSHOT, chain[:4], Tier.SSD) == 4
    assert view.walk(2, chain, ALL_SLOTS) == [(3, 8, 3), (9, 4, 4)]
    assert view.walk(2, chain, 1 << 9) == [(9, 4, 4)]  # slot 3 not live
    assert view.walk(2, chain[1:], ALL_SLOTS) == [(3, 7, 3), (9, 3, 3)]
    assert view.walk(1, chain, ALL_SLOTS) == [] and view.walk(2, [], ALL_SLOTS) == []
    assert view.holders(2, chain[3]) == (0, (1 << 3) | (1 << 9))
    assert view.apply(2, 3, Op.EVICT, chain[4:6]) == 2  # a hole: slot 3's prefix ends at 4
    assert [(s, h.prefix_len, h.ssd_blocks, h.tier) for s, h in view.held(2, chain).items()] == [
        (3, 4, 2, Tier.SSD), (9, 4, 4, Tier.SSD)]
    # Blocks a slot holds after its prefix ended count for nothing, on SSD or not.
    assert view.apply(2, 9, Op.INSERT, chain[5:8], Tier.SSD) == 3
    assert view.apply(2, 4, Op.INSERT, chain) == 8
    assert view.walk(2, chain, ALL_SLOTS) == [(3, 4, 2), (4, 8, 0), (9, 4, 4)]


def test_the_feeder_goes_on_when_relearning_a_resharded_cluster_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MOVED reply makes the feeder re-learn the cluster's slots; mid-failover that raises
    too, and the feeder thread ended for good (every lookup read Redis until a restart)."""
    import threading
    from types import SimpleNamespace

    import fakeredis

    from pegaflow.cluster import redis_conn
    from pegaflow.meta import view_feed

    monkeypatch.setattr(view_feed, "RETRY_S", 0.0)
    monkeypatch.setattr(view_feed, "is_cluster", lambda r: True)
    monkeypatch.setattr(redis_conn, "is_cluster", lambda r: True)
    feed = view_feed.ViewFeed(fakeredis.FakeRedis(), 0.1)
    relearned: list[int] = []

    def relearn() -> None:
        relearned.append(1)
        raise redis.exceptions.RedisClusterException("no node knows the slots")

    feed.r.nodes_manager = SimpleNamespace(initialize=relearn)  # type: ignore[attr-defined]
    rounds: list[int] = []

    def step() -> bool:
        rounds.append(1)
        if len(rounds) >= 3:
            feed._stop.set()
        raise redis.exceptions.ResponseError("MOVED 866 10.0.0.2:7001")

    feed.step = step  # type: ignore[method-assign]
    t = threading.Thread(target=feed.run)
    t.start()
    t.join(10)
    assert not t.is_alive() and len(rounds) == 3, "the feeder stopped at the first failed re-learn"
    assert len(relearned) == 3


def test_the_view_remembers_a_bounded_number_of_superseded_incarnations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every restart or re-sync supersedes an incarnation; the set of them grew until the
    view started over. A forgotten one is judged superseded again by the registry."""
    import fakeredis

    from pegaflow.meta import view_feed

    monkeypatch.setattr(view_feed, "MAX_DEAD", 3, raising=False)
    feed = view_feed.ViewFeed(fakeredis.FakeRedis(), 0.1)
    for nid in range(10):
        feed._bury(nid)
    assert list(feed._dead) == [7, 8, 9]
