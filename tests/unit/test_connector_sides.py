"""Scheduler and worker sides of PegaKVConnector against an in-memory node (no engine).

These follow vLLM's call order for a request (get_num_new_matched_tokens ->
update_state_after_alloc -> build_connector_meta -> start_load/forward/save -> report ->
second update_state_after_alloc(0) -> request_finished) and check what ends up in the
engine's KV cache and in the node.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pegaflow.connector import scheduler as scheduler_mod
from pegaflow.connector.scheduler import NULL_BLOCK_ID as NULL
from pegaflow.connector.settings import LOAD_ONLY, SAVE_ONLY, ConnectorSettings
from tests.unit.connector_fakes import Engine, FakeNode, identity

BS = 16


def prompt(seed: int, n: int = 5 * BS + 3) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(n)]


def test_second_engine_loads_every_full_block_but_never_the_last_token() -> None:
    node = FakeNode()
    a = Engine(node, identity())
    p = prompt(1)
    cold = a.run(p)
    assert cold["external"] == 0
    assert len(node.stored) == 5  # 5 full blocks; the partial 6th is never stored
    assert not node.reservations and not node.leases

    b = Engine(node, identity())
    warm = b.run(p)
    assert warm["external"] == 5 * BS and not warm["errors"]
    for i, got in enumerate(warm["loaded"][0]):
        assert got == b.expected(0, p, i)
    assert not node.leases, "leases are released once the step's report arrived"

    exact = prompt(2, 4 * BS)  # a prompt of exactly 4 blocks: at most 3 may be claimed
    a.run(exact)
    assert Engine(node, identity()).run(exact)["external"] == 3 * BS


def test_a_prefix_of_a_stored_prompt_hits_and_a_divergent_tail_does_not() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(1))
    p2 = prompt(1)[: 3 * BS] + prompt(9)[: 2 * BS + 1]
    out = Engine(node, identity()).run(p2)
    assert out["external"] == 3 * BS


def test_extra_keys_separate_requests_with_the_same_tokens() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(1), cache_salt="tenant-a")
    assert Engine(node, identity()).run(prompt(1), cache_salt="tenant-b")["external"] == 0
    assert Engine(node, identity()).run(prompt(1), cache_salt="tenant-a")["external"] == 5 * BS


def test_tp2_each_rank_saves_and_loads_its_own_shard_and_a_hit_needs_both() -> None:
    node = FakeNode()
    ident = identity(tp=2)
    a = Engine(node, ident)
    p = prompt(3)
    a.run(p)
    assert {ns for ns, _ in node.stored} == set(ident.namespaces)
    assert len(node.stored) == 2 * 5

    b = Engine(node, ident)
    warm = b.run(p)
    assert warm["external"] == 5 * BS
    for rank in (0, 1):
        for i, got in enumerate(warm["loaded"][rank]):
            assert got == b.expected(rank, p, i), f"rank {rank} block {i}"
    # rank 0 and rank 1 hold different KV (different heads)
    assert warm["loaded"][0][0] != warm["loaded"][1][0]

    # drop shard 1 of block 2: the hit must stop at block 2 for both ranks
    h = [k for k in node.stored if k[0] == ident.namespace(1)]
    hashes = [k[1] for k in sorted(h, key=lambda k: node.stored[k])]
    del node.stored[(ident.namespace(1), hashes[2])]
    assert Engine(node, ident).run(p)["external"] == 2 * BS


def test_mla_is_stored_once_by_one_rank_and_loaded_into_every_rank() -> None:
    node = FakeNode()
    ident = identity(tp=2, mla=True)
    a = Engine(node, ident)
    p = prompt(4)
    cold = a.run(p)
    assert len(ident.namespaces) == 1
    assert len(node.stored) == 5, "one copy per block, not one per rank"
    assert all(len(sv.shards) == 1 for sv in cold["meta"].saves)

    b = Engine(node, ident)
    warm = b.run(p)
    assert warm["external"] == 5 * BS
    for rank in (0, 1):
        for i, got in enumerate(warm["loaded"][rank]):
            assert got == b.expected(rank, p, i)
    assert warm["loaded"][0] == warm["loaded"][1]


def test_node_down_means_no_hit_no_save_no_error_and_hits_resume() -> None:
    node = FakeNode()
    node.up = False
    a = Engine(node, identity())
    assert not a.sched.link.ready
    out = a.run(prompt(5))
    assert out["external"] == 0 and not out["meta"].saves
    calls_while_down = node.calls["query"] + node.calls["reserve"]
    a.run(prompt(5))
    assert node.calls["query"] + node.calls["reserve"] == calls_while_down, "no RPC while the link is down"

    node.up = True
    assert a.sched.link.wait_ready(10.0), "the link reconnects in the background"
    for w in a.workers:
        assert w.link is not None and w.link.wait_ready(10.0)
    a.run(prompt(5))
    assert Engine(node, identity()).run(prompt(5))["external"] == 5 * BS


def test_node_restart_between_query_and_copy_is_a_load_error_not_wrong_kv() -> None:
    node = FakeNode()
    a = Engine(node, identity())
    p = prompt(6)
    a.run(p)
    b = Engine(node, identity())
    # Scheduler answers with offsets of epoch 1 ...
    req = b.request(p)
    n, _ = b.sched.get_num_new_matched_tokens(req, 0)
    assert n == 5 * BS
    # ... the node restarts, the worker re-attaches to epoch 2 before the copy
    node.restart()
    b.workers[0].link.reconnect()
    assert b.workers[0].link.wait_ready(10.0) and b.workers[0].link.epoch == 2
    ids = list(range(1, 7))  # block 0 is vLLM's null block
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(ids),)), n)
    meta = b.sched.build_connector_meta(_new_step(req, ids, n, len(p)))
    b.workers[0].start_load(meta)
    assert b.workers[0].take_load_errors() == set(ids[:5])
    assert all(b.block_content(0, i) == [0.0] * 4 for i in ids[:5]), "nothing copied from the wrong pool"


def test_failed_save_is_aborted_never_committed() -> None:
    node = FakeNode()
    a = Engine(node, identity())
    a.workers[0]._save_pages = lambda *args: (_ for _ in ()).throw(RuntimeError("copy failed"))
    a.run(prompt(7))
    assert not node.stored and not node.reservations
    assert node.calls["abort"] >= 1 and node.calls["commit"] == 0


def test_loading_answer_waits_without_busy_spinning_then_recomputes(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]  # the scheduler's monotonic clock, advanced by hand
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    node = FakeNode()
    Engine(node, identity()).run(prompt(8))
    b = Engine(node, identity())
    node.loading = 10**6
    req = b.request(prompt(8))
    before = node.calls["query"]
    answers = [b.sched.get_num_new_matched_tokens(req, 0) for _ in range(200)]
    assert answers[0] == (None, False)
    assert all(a == (None, False) for a in answers)
    assert node.calls["query"] - before == 1, "re-asked the node on every scheduler poll"
    clock[0] += scheduler_mod.LOADING_POLL_S
    assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert node.calls["query"] - before == 2, "asks again once the poll interval passed"

    clock[0] += scheduler_mod.LOADING_WAIT_S  # still LOADING after the longest wait: recompute
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)

    node.loading = 1
    monkeypatch.setattr(scheduler_mod, "LOADING_WAIT_S", 10.0)
    req2 = b.request(prompt(8))
    assert b.sched.get_num_new_matched_tokens(req2, 0) == (None, False)
    clock[0] += scheduler_mod.LOADING_POLL_S
    assert b.sched.get_num_new_matched_tokens(req2, 0) == (5 * BS, False)


def test_asking_again_releases_the_earlier_lease() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(9))
    b = Engine(node, identity())
    req = b.request(prompt(9))
    for _ in range(3):
        assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    assert len(node.leases) == 1
    b.sched.request_finished(req)
    assert not node.leases


def test_local_prefix_hit_covering_the_stored_prefix_loads_nothing() -> None:
    node = FakeNode()
    Engine(node, identity()).run(prompt(10))
    b = Engine(node, identity())
    req = b.request(prompt(10))
    assert b.sched.get_num_new_matched_tokens(req, 5 * BS) == (0, False)
    assert b.sched.get_num_new_matched_tokens(req, 2 * BS) == (3 * BS, False)
    assert len(node.leases) == 1
    from types import SimpleNamespace

    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert not node.leases


def test_a_local_hit_that_ends_inside_a_block_loads_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's own cache may hit part of a block (a prefix match unit below the block size):
    pages are whole blocks, so the answer is no load, not a load vLLM's tokens cannot match."""
    node = FakeNode()
    Engine(node, identity()).run(prompt(10))
    b = Engine(node, identity())
    queries = node.calls["query"]
    req = b.request(prompt(10))
    with caplog.at_level("ERROR"):
        for computed in (BS // 2, BS + BS // 2):
            assert b.sched.get_num_new_matched_tokens(req, computed) == (0, False)
        b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    assert node.calls["query"] == queries and not node.leases
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert b.sched.get_num_new_matched_tokens(req, BS) == (4 * BS, False), "an aligned local hit still loads"


def test_a_request_the_node_rejects_is_a_miss_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    from tests.unit.connector_fakes import FakeNodeClient, FakeRejected

    node = FakeNode()
    Engine(node, identity()).run(prompt(11))
    b = Engine(node, identity())

    def reject(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise FakeRejected("INVALID_ARGUMENT: bad hashes")

    orig = FakeNodeClient.query
    FakeNodeClient.query = reject  # type: ignore[method-assign]
    try:
        with caplog.at_level("ERROR"):
            assert b.sched.get_num_new_matched_tokens(b.request(prompt(11)), 0) == (0, False)
            assert b.sched.get_num_new_matched_tokens(b.request(prompt(11)), 0) == (0, False)
    finally:
        FakeNodeClient.query = orig  # type: ignore[method-assign]
    assert sum("rejected" in r.message for r in caplog.records) == 1
    assert b.sched.link.ready, "a rejected request does not mean the node is down"


def test_lora_and_multimodal_inputs_reach_the_block_hashes() -> None:
    from types import SimpleNamespace

    from pegaflow.connector.scheduler import extra_keys_of

    req = SimpleNamespace(
        lora_request=SimpleNamespace(lora_name="sql-adapter", lora_path="/adapters/sql"),
        cache_salt="s1",
        mm_features=[SimpleNamespace(identifier="img:abc", mm_position=SimpleNamespace(offset=20, length=8))],
    )
    keys = extra_keys_of(req)
    assert keys.lora_name == "sql-adapter" and keys.lora_path == "/adapters/sql" and keys.cache_salt == "s1"
    assert keys.mm_items[0].identifier == "img:abc" and keys.mm_items[0].offset == 20

    node = FakeNode()
    Engine(node, identity()).run(prompt(12), lora_request=SimpleNamespace(lora_name="a"))
    assert Engine(node, identity()).run(prompt(12), lora_request=SimpleNamespace(lora_name="b"))["external"] == 0
    assert Engine(node, identity()).run(prompt(12))["external"] == 0
    assert Engine(node, identity()).run(prompt(12), lora_request=SimpleNamespace(lora_name="a"))["external"] == 5 * BS
    # One name, another adapter (loaded again from another path, or another engine's weights).
    Engine(node, identity()).run(prompt(13), lora_request=SimpleNamespace(lora_name="a", lora_path="/x"))
    assert Engine(node, identity()).run(prompt(13), lora_request=SimpleNamespace(lora_name="a", lora_path="/y"))[
        "external"] == 0
    assert Engine(node, identity()).run(prompt(13), lora_request=SimpleNamespace(lora_name="a", lora_path="/x"))[
        "external"] == 5 * BS


def answer(seed: int, n: int) -> list[int]:
    return [(seed * 104729 + i * 17) % 5000 for i in range(n)]


def test_generated_full_blocks_are_saved_so_the_next_turn_hits_the_answer() -> None:
    node = FakeNode()
    p, a = prompt(1), answer(1, 2 * BS + 5)
    cold = Engine(node, identity()).run(p, generate=a)
    # KV exists for every token but the last sampled one: prompt + answer - 1 positions.
    computed = len(p) + len(a) - 1
    assert len(node.stored) == computed // BS
    assert sum(len(sh.block_ids) for sv in cold["decode_saves"] for sh in sv.shards) == computed // BS - len(p) // BS

    turn2 = p + a + prompt(7, 2 * BS)
    b = Engine(node, identity())
    warm = b.run(turn2)
    assert warm["external"] == computed // BS * BS, "turn 2 hits the prompt and the answer's full blocks"
    for i, got in enumerate(warm["loaded"][0]):
        assert got == b.expected(0, turn2, i), f"block {i}"


def test_decode_block_saves_can_be_turned_off() -> None:
    node = FakeNode()
    off = ConnectorSettings(save_decode_blocks=False)
    p, a = prompt(1), answer(1, 2 * BS + 5)
    Engine(node, identity(), settings=off).run(p, generate=a)
    assert len(node.stored) == len(p) // BS
    assert Engine(node, identity()).run(p + a + prompt(7, BS))["external"] == len(p) // BS * BS


def test_a_block_is_hashed_only_once_all_its_tokens_are_known() -> None:
    """Async scheduling: vLLM may schedule a position whose token is not sampled yet; the
    block waits for its tokens (it is saved a step later), it is never named by a guess."""
    node = FakeNode()
    eng = Engine(node, identity())
    p = prompt(2, 3 * BS - 1)  # the first decode step completes block 2
    req = eng.request(p)
    eng.sched.get_num_new_matched_tokens(req, 0)
    st = eng.sched._reqs[req.request_id]
    st.block_ids = [0, 1, 2]
    assert eng.sched._known_hashes(st, 3) == 2, "token 3*BS-1 is not in all_token_ids yet"
    req.all_token_ids.append(42)
    assert eng.sched._known_hashes(st, 3) == 3


def test_save_only_never_loads_and_load_only_never_saves() -> None:
    node = FakeNode()
    p = prompt(3)
    prefill = Engine(node, identity(), settings=ConnectorSettings(mode=SAVE_ONLY))
    assert prefill.run(p)["external"] == 0
    assert len(node.stored) == 5
    assert prefill.run(p)["external"] == 0, "a save_only engine never loads, even what it saved"

    decode = Engine(node, identity(), settings=ConnectorSettings(mode=LOAD_ONLY))
    reserves = node.calls["reserve"]
    assert decode.run(p)["external"] == 5 * BS
    out = decode.run(prompt(4), generate=answer(4, 2 * BS))
    assert out["meta"].saves == () and out["decode_saves"] == []
    assert node.calls["reserve"] == reserves, "a load_only engine never reserves"


def test_reset_cache_drops_the_engines_namespaces_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    node = FakeNode()
    a = Engine(node, identity())
    a.run(prompt(1))
    assert Engine(node, identity()).run(prompt(1))["external"] == 5 * BS
    with caplog.at_level("INFO", logger="vllm.pegaflow"):
        assert a.sched.reset_cache() is True
    assert "reset dropped 5 blocks" in caplog.text
    assert Engine(node, identity()).run(prompt(1))["external"] == 0
    node.up = False
    a.sched.link.call(lambda c: c.query([], []))  # the link notices the node is gone
    assert a.sched.reset_cache() is False


@pytest.mark.parametrize("tier, source", [("ssd", "disk"), ("remote", "p2p")])
def test_hit_sources_split_the_tokens_by_the_tier_that_held_them(
    monkeypatch: pytest.MonkeyPatch, tier: str, source: str
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    node = FakeNode()
    p = prompt(10)
    Engine(node, identity()).run(p)
    b = Engine(node, identity())

    req = b.request(p)  # every block in DRAM: all "host"
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    assert b.sched.hit_sources(req, 5 * BS) == {"host": 5 * BS}

    # 2 blocks in DRAM, the other 3 promoted from SSD / pulled from a peer while it waited;
    # the engine itself already holds block 0 (a local prefix hit).
    node.loading, node.loading_dram, node.loading_from = 1, 2, tier
    req = b.request(p)
    assert b.sched.get_num_new_matched_tokens(req, BS) == (None, False)
    clock[0] += scheduler_mod.LOADING_POLL_S
    n, _ = b.sched.get_num_new_matched_tokens(req, BS)
    assert n == 4 * BS
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(1, 7)),)), n)
    split = b.sched.hit_sources(req, n)
    assert split == {"host": BS, source: 3 * BS} and sum(split.values()) == n
    assert b.sched.hit_sources(req, 0) == {}


def events_engine():  # type: ignore[no-untyped-def]
    """An engine whose scheduler side produces vLLM KV events."""
    from pegaflow.connector.events import KVEvents

    ident = identity()
    ev = KVEvents(ident.namespaces[0], BS)
    return ident, ev, Engine(FakeNode(), ident, events=ev)


def test_kv_events_announce_committed_blocks_and_what_the_node_lost() -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from pegaflow.client import BlockEvents
    from pegaflow.core.identity import block_hashes

    ident, ev, eng = events_engine()
    p = prompt(11)
    eng.run(p)
    hs = [maybe_convert_block_hash(h) for h in block_hashes(ident.seed, p, BS)]  # as vLLM names them
    ours = block_hashes(ident.seed, p, BS)
    (stored,) = ev.take()
    assert isinstance(stored, BlockStored) and stored.medium == "CPU"
    assert stored.block_hashes == hs and stored.token_ids == p[:5 * BS] and stored.parent_block_hash is None
    assert ev.take() == [], "each event once"

    ev.on_blocks([BlockEvents(ident.namespaces[0], "dram", False, [ours[3], ours[4], b"x" * 16]),
                  BlockEvents("another-namespace", "dram", False, [ours[0]])], 0)
    ev.on_blocks([BlockEvents(ident.namespaces[0], "ssd", True, [ours[3]])], 0)
    removed, on_ssd = ev.take()
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert removed.block_hashes == [hs[3], hs[4]], "only blocks this engine announced, only its namespace"
    assert isinstance(on_ssd, BlockStored) and on_ssd.medium == "STORAGE"
    assert on_ssd.block_hashes == [hs[3]] and on_ssd.parent_block_hash == hs[2]
    assert on_ssd.token_ids == p[3 * BS:4 * BS]

    ev.on_blocks([BlockEvents(ident.namespaces[0], "ssd", False, [ours[3]])], 0)
    (gone,) = ev.take()
    assert gone.block_hashes == [hs[3]] and gone.medium == "STORAGE"
    ev.on_blocks([BlockEvents(ident.namespaces[0], "ssd", True, [ours[3]])], 0)
    assert ev.take() == [], "a block gone from every medium is forgotten"


def test_kv_events_use_vllms_block_hashes_when_the_request_has_them() -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    _, ev, eng = events_engine()
    p = prompt(12)
    vllm_hashes = [bytes([i]) * 32 for i in range(5)]
    eng.run(p, block_hashes=vllm_hashes)
    (stored,) = ev.take()
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in vllm_hashes]


def idle_step() -> SimpleNamespace:
    """A scheduler output with nothing scheduled (the request waits for its KV)."""
    return SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()))


def run_step(eng: Engine, meta) -> set[str]:  # type: ignore[no-untyped-def]
    """Workers handle ``meta``; returns what they report finished (get_finished)."""
    done: set[str] = set()
    report = None
    for w in eng.workers:
        w.start_load(meta)
        w.save(meta)
        r = w.report(meta)
        report = r if report is None else report.aggregate(r)
        done |= w.take_finished_recving()
        eng.load_errors |= w.take_load_errors()
    eng.sched.update_connector_output(report)
    return done


def async_setup(monkeypatch: pytest.MonkeyPatch, expected: int = 5, tp: int = 1):  # type: ignore[no-untyped-def]
    clock = [1000.0]
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    node = FakeNode()
    p = prompt(13)
    Engine(node, identity(tp=tp)).run(p)
    b = Engine(node, identity(tp=tp))
    node.loading, node.loading_dram, node.loading_from, node.loading_expected = 2, 1, "ssd", expected
    req = b.request(p)
    block_ids = [b.free.pop() for _ in range(6)]
    return clock, node, b, p, req, block_ids


def test_blocks_still_on_ssd_load_asynchronously_while_the_engine_runs_others(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, node, b, p, req, block_ids = async_setup(monkeypatch)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 5 * BS)
    assert b.sched.hit_sources(req, 5 * BS) == {"host": BS, "disk": 4 * BS}

    meta = b.sched.build_connector_meta(idle_step())  # polled too soon: nothing yet
    assert meta.loads == () and run_step(b, meta) == set()
    clock[0] += scheduler_mod.LOADING_POLL_S
    meta = b.sched.build_connector_meta(idle_step())  # the node still loads
    assert meta.loads == () and run_step(b, meta) == set()
    clock[0] += scheduler_mod.LOADING_POLL_S
    meta = b.sched.build_connector_meta(idle_step())  # in DRAM now: the copy goes out
    (ld,) = meta.loads
    assert ld.is_async and ld.block_ids == tuple(block_ids[:5]) and ld.missing == ()
    assert run_step(b, meta) == {req.request_id}, "finished only once the copy was made"
    for i, blk in enumerate(block_ids[:5]):
        assert b.block_content(0, blk) == b.expected(0, p, i)
    assert not b.load_errors and not node.leases, "the lease ends with the step"
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 0)
    assert b.sched.build_connector_meta(idle_step()).loads == (), "one intent per load"


def test_an_async_load_that_loses_blocks_reports_them_as_load_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, node, b, p, req, block_ids = async_setup(monkeypatch)
    node.loading = 1
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 5 * BS)
    third = sorted(node.stored, key=lambda k: node.stored[k])[3]
    del node.stored[third]  # evicted before the promotion finished
    clock[0] += scheduler_mod.LOADING_POLL_S
    meta = b.sched.build_connector_meta(idle_step())
    (ld,) = meta.loads
    assert ld.block_ids == tuple(block_ids[:3]) and ld.missing == tuple(block_ids[3:5])
    assert run_step(b, meta) == {req.request_id}
    assert b.load_errors == set(block_ids[3:5])


def test_an_async_load_that_never_lands_gives_up_and_recomputes(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, node, b, p, req, block_ids = async_setup(monkeypatch)
    node.loading = 10**6
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 5 * BS)
    clock[0] += scheduler_mod.LOADING_WAIT_S
    meta = b.sched.build_connector_meta(idle_step())
    (ld,) = meta.loads
    assert ld.block_ids == () and ld.missing == tuple(block_ids[:5])
    assert run_step(b, meta) == {req.request_id} and b.load_errors == set(block_ids[:5])
    # vLLM recomputes from block 0, asks again, and must get no second promise (the node still
    # says LOADING: each promise would end the same, for ever).
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_request_whose_async_load_failed_on_a_worker_is_not_promised_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock, node, b, p, req, block_ids = async_setup(monkeypatch)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    b.sched.update_connector_output(None, failed_recving={req.request_id})  # vLLM's failed_recving
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_aborted_before_its_async_load_went_out_is_still_reported_received(
        monkeypatch: pytest.MonkeyPatch, tp: int) -> None:
    """vLLM frees a request that finished while WAITING_FOR_REMOTE_KVS only once every rank
    reported it received (no timeout): an abort before the load's intent went out must still
    end in one, with nothing to copy, or its blocks stay allocated for good."""
    clock, node, b, p, req, block_ids = async_setup(monkeypatch, tp=tp)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, True)
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), 5 * BS)
    assert run_step(b, b.sched.build_connector_meta(idle_step())) == set(), "polled too soon: not issued yet"
    before = [b.block_content(0, blk) for blk in block_ids[:5]]
    assert b.sched.request_finished(req) == (False, None)  # the client went away
    meta = b.sched.build_connector_meta(idle_step())
    (ld,) = meta.loads
    assert ld.req_id == req.request_id and ld.is_async and ld.block_ids == () and ld.missing == ()
    for w in b.workers:  # every rank reports it, once
        w.start_load(meta)
        w.save(meta)
        assert w.take_finished_recving() == {req.request_id}
        assert w.take_load_errors() == set() and w.take_finished_recving() == set()
        assert w.report(meta).copies.load_failures == 0, "no copy was tried, none failed"
    assert [b.block_content(0, blk) for blk in block_ids[:5]] == before, "nothing copied"
    clock[0] += scheduler_mod.LOADING_WAIT_S
    assert b.sched.build_connector_meta(idle_step()).loads == (), "one intent"
    assert not node.leases, "what the answer leased is released"


def test_async_load_off_keeps_the_request_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, node, b, p, req, block_ids = async_setup(monkeypatch)
    b.sched.settings = ConnectorSettings(async_load=False)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)


@pytest.mark.parametrize("tp, failing", [(1, 0), (2, 1)], ids=["tp1", "tp2-rank1-fails"])
def test_a_failed_load_never_stores_the_kv_computed_over_it(tp: int, failing: int) -> None:
    """vLLM runs the forward before it learns a load failed: the blocks the step computes
    attend to KV cache blocks that were never loaded (on the failing rank, and through the
    layers' all-reduce on every other). No shard of them may reach the node, where every
    later hit would load it."""
    node = FakeNode()
    ident = identity(tp=tp)
    Engine(node, ident).run(prompt(1, 4 * BS + 3))
    assert len(node.stored) == 4 * tp
    commits = node.calls["commit"]
    b = Engine(node, ident)
    b.workers[failing]._load_pages = lambda *args: (_ for _ in ()).throw(RuntimeError("copy failed"))
    got = b.run(prompt(1, 8 * BS + 3))  # hits 4 blocks, computes 4 more in the same step
    assert got["external"] == 4 * BS and got["errors"] == set(got["block_ids"][:4])
    assert len(node.stored) == 4 * tp, "blocks computed over the failed load were stored"
    assert not node.reservations and node.calls["commit"] == commits and node.calls["abort"] >= 1
    assert b.workers[failing].stats["poisoned_saves"] >= 1


def _new_step(req, ids: list[int], computed: int, total: int) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(list(ids),), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: total - computed},
    )


def test_a_sliding_window_models_null_block_is_never_saved_nor_loaded_into() -> None:
    """A model whose one KV cache group is sliding-window attention: vLLM's block table holds
    its null block (id 0, shared by every request) at the positions below the window."""
    node = FakeNode()
    p = prompt(4, 8 * BS + 3)
    a = Engine(node, identity())
    req = a.request(p)
    assert a.sched.get_num_new_matched_tokens(req, 4 * BS) == (0, False)  # vLLM's own cache: 4 blocks
    ids = [NULL, NULL] + [a.free.pop() for _ in range(7)]  # the first 2 below the window
    a.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(ids),)), 0)
    meta = a.sched.build_connector_meta(_new_step(req, ids, 4 * BS, len(p)))
    saved = [b for sv in meta.saves for s in sv.shards for b in s.block_ids]
    assert sorted(saved) == sorted(ids[2:8]), "the null block's bytes saved under a real block's hash"

    Engine(node, identity()).run(p)  # the node holds all 8 blocks
    b = Engine(node, identity())
    req = b.request(p)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (8 * BS, False)
    ids = [NULL, NULL] + [b.free.pop() for _ in range(7)]
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(ids),)), 8 * BS)
    meta = b.sched.build_connector_meta(_new_step(req, ids, 8 * BS, len(p)))
    (load,) = meta.loads
    assert list(load.block_ids) == ids[2:8] and all(len(o) == 6 for o in load.offsets)
    b.workers[0].start_load(meta)
    assert not b.workers[0].take_load_errors()
    assert [b.block_content(0, blk) for blk in ids[2:8]] == [b.expected(0, p, i) for i in range(2, 8)]
    assert b.block_content(0, NULL) == [0.0] * len(b.block_content(0, NULL)), "a load wrote into the null block"


def test_a_prompt_with_embeddings_is_neither_stored_nor_looked_up() -> None:
    """A prompt mixing text and embeddings carries token ids too, with a placeholder id where
    an embedding goes: two such prompts with other embeddings have the same ids."""
    import torch

    node = FakeNode()
    p = prompt(5)
    a = Engine(node, identity())
    assert a.run(p, prompt_embeds=torch.ones(len(p), 8))["external"] == 0
    assert not node.stored, "KV of embeddings stored under token ids that do not name them"
    a.run(p)  # the same ids as text: stored, and found again as text
    b = Engine(node, identity())
    assert b.run(p, prompt_embeds=torch.zeros(len(p), 8))["external"] == 0, "another prompt's KV loaded"
    assert b.run(p)["external"] == 5 * BS
