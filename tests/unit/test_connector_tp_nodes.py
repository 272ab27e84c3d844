"""TP ranks on several nodes (``pegaflow.tp_shard_endpoints``): each group of ranks copies to
and from its own node, the scheduler side asks every node and loads the prefix all of them
hold, and every lease and reservation goes back to the node that issued it.

Two in-memory nodes (``FakeNode``) with the node's contract; the scheduler and worker sides
are driven through vLLM's call order (``Engine``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pegaflow.connector import scheduler as scheduler_mod
from pegaflow.connector.placement import Place, Placement, check_tp_only
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.core.identity import NO_EXTRA_KEYS, block_hashes
from tests.unit.connector_fakes import Engine, FakeNode, identity

BS = 16


def prompt(seed: int, n: int = 5 * BS + 3) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(n)]


def two_nodes(b_ids_from: int = 1) -> tuple[FakeNode, FakeNode]:
    """Nodes A and B; by default their lease and reservation ids are the same numbers, so an
    id sent to the wrong node would find something there."""
    return FakeNode(node_id="node-a"), FakeNode(node_id="node-b", ids_from=b_ids_from)


def namespaces_on(node: FakeNode) -> set[str]:
    return {ns for ns, _ in node.stored}


def scheduled(req: Any, block_ids: list[int], n_ext: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(list(block_ids),),
                                            num_computed_tokens=n_ext)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: len(req.prompt_token_ids) - n_ext},
    )


# -- placement --------------------------------------------------------------------------------

def test_ranks_split_into_equal_contiguous_groups_each_shard_on_its_groups_node() -> None:
    p = Placement.of(identity(tp=4, heads=4), 2)
    assert [p.node_of_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert p.places == (Place(0, 0), Place(1, 0), Place(2, 1), Place(3, 1))
    assert [p.place_of_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert all(p.writes(r) for r in range(4))
    assert p.on_node(1) == (2, 3)


def test_a_replicated_shard_has_a_place_and_a_writer_on_each_node() -> None:
    p = Placement.of(identity(tp=4, mla=True), 2)
    assert p.places == (Place(0, 0), Place(0, 1))
    assert [p.place_of_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [p.writes(r) for r in range(4)] == [True, False, True, False]


def test_one_node_keeps_one_place_per_shard_in_shard_order() -> None:
    for ident in (identity(tp=2), identity(tp=4, heads=4), identity(tp=2, mla=True)):
        p = Placement.of(ident)
        assert [pl.shard for pl in p.places] == list(range(ident.num_shards))
        assert [p.place_of_rank(r) for r in range(ident.tp_size)] == [ident.shard_of_rank(r)
                                                                       for r in range(ident.tp_size)]
        per_shard = ident.tp_size // ident.num_shards  # one node: the first rank of each shard writes it
        assert [p.writes(r) for r in range(ident.tp_size)] == [r % per_shard == 0 for r in range(ident.tp_size)]


def test_the_originals_refusals() -> None:
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=2 must be divisible by the 4 PegaFlow TP shards$"):
        Placement.of(identity(tp=2), 4)
    with pytest.raises(ValueError, match="pegaflow.tp_shard_endpoints currently supports TP-only parallelism; "
                                         "got tp_size=2, world_size=4, dcp_world_size=1, pcp_world_size=1"):
        check_tp_only(2, 2, 4, 1, 1)
    with pytest.raises(ValueError, match="dcp_world_size=2"):
        check_tp_only(2, 2, 2, 2, 1)
    check_tp_only(1, 2, 4, 2, 2)  # one node: whatever the parallelism


# -- saves and loads -----------------------------------------------------------------------------

def test_each_shard_is_saved_on_its_ranks_node_and_loaded_from_both() -> None:
    a, b = two_nodes()
    ident = identity(tp=2)
    p = prompt(1)
    assert Engine(None, ident, nodes=(a, b)).run(p)["external"] == 0
    assert namespaces_on(a) == {ident.namespace(0)} and namespaces_on(b) == {ident.namespace(1)}
    assert len(a.stored) == len(b.stored) == 5

    warm_engine = Engine(None, ident, nodes=(a, b))
    queries = a.calls["query"], b.calls["query"]
    warm = warm_engine.run(p)
    assert warm["external"] == 5 * BS and not warm["errors"]
    for rank in (0, 1):
        assert [warm_engine.block_content(rank, blk) for blk in warm["block_ids"][:5]] == \
            [warm_engine.expected(rank, p, i) for i in range(5)], f"rank {rank}"
    assert warm["loaded"][0] != warm["loaded"][1], "each rank got its own shard"
    for node in (a, b):
        assert not node.leases and not node.reservations, node.node_id
    assert (a.calls["query"], b.calls["query"]) == (queries[0] + 1, queries[1] + 1), \
        "equal hits: one Query per node, no second lease"


def test_one_node_keeps_its_rpcs_one_query_one_release_one_reserve_per_shard() -> None:
    node = FakeNode()
    ident = identity(tp=2)
    p = prompt(10)
    Engine(node, ident).run(p)
    assert (node.calls["query"], node.calls["reserve"], node.calls["commit"]) == (1, 2, 2)
    before = node.calls.copy()
    assert Engine(node, ident).run(p)["external"] == 5 * BS
    assert (node.calls - before) == {"register": 3, "query": 1, "release": 1}


def test_mla_on_two_nodes_stores_one_copy_per_node_by_the_first_rank_there() -> None:
    a, b = two_nodes()
    ident = identity(tp=4, mla=True)
    p = prompt(2)
    cold = Engine(None, ident, nodes=(a, b)).run(p)
    assert [[s.place for s in sv.shards] for sv in cold["meta"].saves] == [[0, 1]]
    assert namespaces_on(a) == namespaces_on(b) == {ident.namespace(0)} and len(a.stored) == len(b.stored) == 5
    eng = Engine(None, ident, nodes=(a, b))
    warm = eng.run(p)
    assert warm["external"] == 5 * BS and not warm["errors"]
    assert all(warm["loaded"][r] == warm["loaded"][0] for r in range(4))
    assert warm["loaded"][0] == [eng.expected(0, p, i) for i in range(5)]


def test_the_hit_is_the_common_prefix_leased_again_at_exactly_that_length() -> None:
    a, b = two_nodes()
    ident = identity(tp=2)
    p = prompt(3)
    Engine(None, ident, nodes=(a, b)).run(p)
    # node B lost blocks 3 and 4 of its shard: only 3 blocks are on both nodes
    for h in block_hashes(ident.seed, p, BS, NO_EXTRA_KEYS)[3:5]:
        del b.stored[ident.namespace(1), h]
    eng = Engine(None, ident, nodes=(a, b))
    before_a, before_b = a.calls.copy(), b.calls.copy()
    req = eng.request(p)
    n, is_async = eng.sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (3 * BS, False)
    assert list(a.lease_blocks.values()) == [3], "A's 5-block lease is released, a 3-block one taken"
    assert list(b.lease_blocks.values()) == [3]
    assert (a.calls - before_a) == {"query": 2, "release": 1} and (b.calls - before_b) == {"query": 1}

    blocks = list(range(1, 7))
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), n)
    meta = eng.sched.build_connector_meta(scheduled(req, blocks, n))
    (ld,) = meta.loads
    assert [len(o) for o in ld.offsets] == [3, 3]
    assert not a.reservations, "A holds blocks 3 and 4 already"
    assert [len(items) for items in b.reservations.values()] == [2], "B gets them back"


def test_one_node_down_is_a_miss_and_nothing_stays_leased_on_the_other() -> None:
    a, b = two_nodes()
    ident = identity(tp=2)
    p = prompt(4)
    Engine(None, ident, nodes=(a, b)).run(p)
    eng = Engine(None, ident, nodes=(a, b))
    b.up = False  # the links do not know yet: A answers, B's Query fails
    before = a.calls.copy()
    out = eng.run(p)
    assert out["external"] == 0 and not out["errors"]
    assert (a.calls - before) == {"query": 1, "release": 1} and not a.leases, "A's lease was released at once"
    assert not out["meta"].saves and not a.reservations, "no save while a node is unreachable"
    assert not eng.sched.nodes_ready()
    # and back: hits resume once B's links reconnect
    b.up = True
    for link in (*eng.sched.links, *(w.link for w in eng.workers)):
        assert link is not None and link.wait_ready(10.0)
    assert eng.run(p)["external"] == 5 * BS
    assert not a.leases and not b.leases


def test_a_node_promoting_blocks_makes_the_answer_loading_then_the_async_load_comes_from_both(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]  # the scheduler's monotonic clock, advanced by hand
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    a, b = two_nodes()
    ident = identity(tp=2)
    p = prompt(5)
    Engine(None, ident, nodes=(a, b)).run(p)
    eng = Engine(None, ident, nodes=(a, b), settings=ConnectorSettings())
    b.loading, b.loading_dram, b.loading_from, b.loading_expected = 1, 2, "ssd", 4
    req = eng.request(p)
    n, is_async = eng.sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (4 * BS, True), "the prefix every node will hold, loaded asynchronously"
    assert not a.leases and not b.leases, "nothing stays leased while a node promotes"
    blocks = list(range(1, 7))
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), n)

    clock[0] += scheduler_mod.LOADING_POLL_S
    meta = eng.sched.build_connector_meta(scheduled(req, blocks, 0))  # both in DRAM now: the copy goes out
    (ld,) = meta.loads
    assert ld.is_async and ld.block_ids == tuple(blocks[:4]) and [len(o) for o in ld.offsets] == [4, 4]
    assert len(a.leases) == len(b.leases) == 1
    report = None
    for w in eng.workers:
        w.start_load(meta)
        assert w.take_finished_recving() == {req.request_id} and not w.take_load_errors()
        r = w.report(meta)
        report = r if report is None else report.aggregate(r)
    eng.sched.update_connector_output(report)
    for rank in (0, 1):
        assert [eng.block_content(rank, blk) for blk in blocks[:4]] == [eng.expected(rank, p, i) for i in range(4)]
    assert not a.leases and not b.leases, "each node's lease ends with the step, on that node"


def test_leases_and_reservations_go_back_to_the_node_that_issued_them() -> None:
    a, b = two_nodes()  # the same ids on both nodes
    ident = identity(tp=2)
    p = prompt(6)
    Engine(None, ident, nodes=(a, b)).run(p)
    assert a.calls["commit"] == b.calls["commit"] == 1 and not a.reservations and not b.reservations
    Engine(None, ident, nodes=(a, b)).run(p)
    assert a.calls["release"] == b.calls["release"] == 1
    assert not a.leases and not b.leases

    # a save that failed on rank 1 is aborted on B; A's reservation is committed
    a, b = two_nodes(b_ids_from=10_000)
    eng = Engine(None, ident, nodes=(a, b))
    eng.workers[1]._save_pages = lambda *args: (_ for _ in ()).throw(RuntimeError("copy failed"))
    eng.run(p)
    assert (a.calls["commit"], a.calls["abort"]) == (1, 0) and len(a.stored) == 5
    assert (b.calls["commit"], b.calls["abort"]) == (0, 1) and not b.stored and not b.reservations


def test_each_rank_checks_the_epoch_of_its_own_node() -> None:
    a, b = two_nodes()
    b.epoch = 7
    ident = identity(tp=2)
    p = prompt(7)
    Engine(None, ident, nodes=(a, b)).run(p)
    eng = Engine(None, ident, nodes=(a, b))
    req = eng.request(p)
    n, _ = eng.sched.get_num_new_matched_tokens(req, 0)
    assert n == 5 * BS
    # B restarts after the answer; rank 1 re-attaches to its epoch 8 before the copy
    b.restart()
    w1 = eng.workers[1]
    assert w1.link is not None
    w1.link.reconnect()
    assert w1.link.wait_ready(10.0) and w1.link.epoch == 8
    blocks = list(range(1, 7))
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), n)
    meta = eng.sched.build_connector_meta(scheduled(req, blocks, n))
    assert [ld.epochs for ld in meta.loads] == [(1, 7)]
    for w in eng.workers:
        w.start_load(meta)
    assert eng.workers[0].take_load_errors() == set() and w1.take_load_errors() == set(blocks[:5])
    assert [eng.block_content(0, blk) for blk in blocks[:5]] == [eng.expected(0, p, i) for i in range(5)]
    assert all(eng.block_content(1, blk) == [0.0] * 4 for blk in blocks[:5]), "nothing copied from B's new pool"


def test_reset_cache_resets_every_node_and_says_when_one_was_unreachable() -> None:
    a, b = two_nodes()
    ident = identity(tp=2)
    eng = Engine(None, ident, nodes=(a, b))
    eng.run(prompt(8))
    assert eng.sched.reset_cache()
    assert not a.stored and not b.stored and a.calls["reset"] == b.calls["reset"] == 1
    eng.run(prompt(9))
    b.up = False
    assert not eng.sched.reset_cache()
    assert not a.stored, "the reachable node is reset all the same"


def test_the_connector_places_shards_from_vllms_parallel_config() -> None:
    from pegaflow.connector.connector import node_pages, shard_placement

    ident = identity(tp=4, heads=4)

    def config(**parallel: int) -> Any:
        pc = dict(tensor_parallel_size=4, world_size=4, decode_context_parallel_size=1, prefill_context_parallel_size=1)
        pc.update(parallel)
        return SimpleNamespace(parallel_config=SimpleNamespace(**pc))

    placement = shard_placement(config(), ident, 2)
    assert node_pages(ident, placement, 1) == {ident.namespace(2): ident.page_bytes, ident.namespace(3): ident.page_bytes}
    with pytest.raises(ValueError, match="must be divisible by the 3 PegaFlow TP shards"):
        shard_placement(config(), ident, 3)
    with pytest.raises(ValueError, match="supports TP-only parallelism"):
        shard_placement(config(prefill_context_parallel_size=2), ident, 2)
    assert shard_placement(config(world_size=8), ident, 1).nodes == 1


def test_a_state_space_model_saves_and_loads_each_ranks_state_through_its_own_node() -> None:
    """Hybrid state-space (Mamba, align mode) at TP=2 over two nodes: attention pages and the
    state page at the hit's end, both per rank, on the rank's node; the hit needs both nodes."""
    import dataclasses

    import torch

    from pegaflow.connector.scheduler import NULL_BLOCK_ID, SchedulerSide
    from pegaflow.connector.worker import WorkerSide
    from tests.unit.connector_fakes import fake_link, kv_value
    from tests.unit.test_connector_state_space import (
        ATTN,
        GROUP_OF,
        STATE,
        STATE_BYTES,
        TOKENS,
        caches,
        idle_step,
        sched_out,
    )

    ident = dataclasses.replace(identity(tp=2, layers=2), state_page_bytes=STATE_BYTES)
    placement = Placement.of(ident, 2)
    bs, nblocks = ident.block_size, -(-len(TOKENS) // ident.block_size)

    def engine(a: FakeNode, b: FakeNode) -> tuple[SchedulerSide, list[WorkerSide], list[dict[str, Any]]]:
        pages = [{ns: ident.page_bytes for ns in [ident.namespaces[r]]} | {ident.state_namespaces[r]: STATE_BYTES}
                 for r in (0, 1)]
        sched = SchedulerSide(ident, [fake_link(n, pages[i]) for i, n in enumerate((a, b))], kv_groups=2,
                              state_groups=frozenset({STATE}), placement=placement)
        workers, kv = [], []
        for rank, n in enumerate((a, b)):
            w = WorkerSide(ident, rank, lambda ns, pci, n=n: fake_link(n, ns, pci), kv_groups=2,
                           state_groups=frozenset({STATE}), placement=placement)
            kv.append(caches(ident, 64))
            w.register_kv_caches(kv[-1], 64, GROUP_OF)
            workers.append(w)
        return sched, workers, kv

    def value(rank: int, layer: int, blocks: int) -> float:
        return float(torch.tensor(kv_value(TOKENS[: blocks * bs], layer, rank), dtype=torch.float16))

    a, b = two_nodes()
    sched, workers, kv = engine(a, b)
    req = SimpleNamespace(request_id="cold", prompt_token_ids=TOKENS, num_prompt_tokens=len(TOKENS),
                          all_token_ids=list(TOKENS), lora_request=None, cache_salt=None, mm_features=[])
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = (list(range(1, nblocks + 1)), list(range(20, 20 + nblocks)))
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), 0)
    meta = sched.build_connector_meta(sched_out(req, ids, 0, len(TOKENS), {"cold": [(STATE, ids[STATE][5], 6 * bs)]}))
    report = None
    for rank, w in enumerate(workers):
        for layer, (name, g) in enumerate(GROUP_OF.items()):
            for i in range(nblocks):
                v = kv_value(TOKENS[: (i + 1) * bs], layer, rank)
                if g == ATTN:
                    kv[rank][name][ids[ATTN][i]].fill_(v)
                else:
                    kv[rank][name][0][ids[STATE][i]].fill_(v)
                    kv[rank][name][1][ids[STATE][i]].fill_(v)
        w.save(meta)
        r = w.report(meta)
        report = r if report is None else report.aggregate(r)
    sched.update_connector_output(report)
    for rank, n in enumerate((a, b)):
        assert namespaces_on(n) == {ident.namespaces[rank], ident.state_namespaces[rank]}
        assert len(n.stored) == 6 + 1, "six attention pages and one state page per node"

    sched, workers, kv = engine(a, b)
    req.request_id = "warm"
    assert sched.get_num_new_matched_tokens(req, 0) == (6 * bs, True)
    ids = ([NULL_BLOCK_ID] * 5 + [30, 31], list(range(40, 40 + nblocks)))
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), 6 * bs)
    meta = sched.build_connector_meta(idle_step())
    assert sorted(ld.state for ld in meta.loads) == [False, True]
    report = None
    for rank, w in enumerate(workers):
        w.start_load(meta)
        assert w.take_finished_recving() == {"warm"} and w.take_failed_recving() == set()
        r = w.report(meta)
        report = r if report is None else report.aggregate(r)
        conv, ssm = kv[rank]["model.layers.2.mixer"]
        assert float(conv[30].flatten()[0]) == value(rank, 2, 6), f"rank {rank}'s own state"
        assert float(kv[rank]["model.layers.3.mixer.attn"][ids[ATTN][2]].flatten()[0]) == value(rank, 3, 3)
    sched.update_connector_output(report)
    assert not a.leases and not b.leases
