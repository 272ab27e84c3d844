"""Several KV cache groups (vLLM's hybrid allocator: full and sliding-window attention).

The fake engine has four layers: 0 and 2 attend fully (group 0), 1 and 3 over a sliding
window (group 1). As in vLLM, one tensor backs one layer of each group (layer 0 with 1,
2 with 3) and the groups take block ids from one pool; a sliding-window group holds
vLLM's null block (id 0) where a block left the window.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pegaflow.client import load_pages, save_pages
from pegaflow.connector.intents import PegaWorkerReport
from pegaflow.connector.layout import build_page_layout
from pegaflow.connector.scheduler import NULL_BLOCK_ID, SchedulerSide
from pegaflow.connector.worker import WorkerSide
from tests.unit.connector_fakes import FakeNode, fake_link, identity, kv_value

LAYERS = 4
GROUP_OF = {f"model.layers.{i}.self_attn.attn": i % 2 for i in range(LAYERS)}


def hybrid_caches(ident: Any, num_blocks: int) -> dict[str, torch.Tensor]:
    buf = torch.zeros(LAYERS // 2, num_blocks, ident.num_kv_heads, ident.block_size, 2 * ident.head_size,
                      dtype=torch.float16)
    return {name: buf[i // 2] for i, name in enumerate(GROUP_OF)}


class HybridEngine:
    """A scheduler side and one worker over a two-group KV cache, driven in vLLM's order."""

    def __init__(self, node: FakeNode, window_blocks: int = 2, num_blocks: int = 64) -> None:
        self.ident = identity(layers=LAYERS)
        self.node = node
        self.window = window_blocks
        ns = {n: self.ident.page_bytes for n in self.ident.namespaces}
        self.sched = SchedulerSide(self.ident, fake_link(node, ns), kv_groups=2)
        self.worker = WorkerSide(self.ident, 0, lambda ns, pci: fake_link(node, ns, pci), kv_groups=2)
        self.caches = hybrid_caches(self.ident, num_blocks)
        self.worker.register_kv_caches(self.caches, num_blocks, GROUP_OF)
        self.free = list(range(num_blocks - 1, NULL_BLOCK_ID, -1))  # block 0 is the null block
        self.ids = itertools.count()

    def request(self, tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(request_id=f"h{next(self.ids)}", prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                               all_token_ids=list(tokens), lora_request=None, cache_salt=None, mm_features=[])

    def alloc(self, nblocks: int, computed_blocks: int) -> tuple[list[int], list[int]]:
        """Group 0 gets every block; group 1 the null block below the window of the computed prefix."""
        full = [self.free.pop() for _ in range(nblocks)]
        swa = [NULL_BLOCK_ID if i < computed_blocks - self.window else self.free.pop() for i in range(nblocks)]
        return full, swa

    def step(self, so: Any) -> tuple[Any, PegaWorkerReport | None]:
        meta = self.sched.build_connector_meta(so)
        self.worker.start_load(meta)
        return meta, None

    def finish_step(self, meta: Any) -> None:
        self.worker.save(meta)
        self.sched.update_connector_output(self.worker.report(meta))

    def forward(self, tokens: list[int], ids: tuple[list[int], list[int]], start_block: int) -> None:
        bs = self.ident.block_size
        for i in range(start_block, len(ids[0])):
            for layer, name in enumerate(GROUP_OF):
                b = ids[GROUP_OF[name]][i]
                if b != NULL_BLOCK_ID:
                    self.caches[name][b].fill_(kv_value(tokens[: (i + 1) * bs], layer, 0))

    def value(self, name: str, b: int) -> float:
        return float(self.caches[name][b].flatten()[0])


def sched_out(req: Any, ids: tuple[list[int], ...], computed: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=ids, num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: scheduled},
    )


def idle_step() -> SimpleNamespace:
    """A step that schedules nothing (the request waits for its asynchronous load)."""
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                                 resumed_req_ids=set()))


def cold_run(eng: HybridEngine, tokens: list[int]) -> None:
    req = eng.request(tokens)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    nblocks = -(-len(tokens) // eng.ident.block_size)
    ids = eng.alloc(nblocks, 0)
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), 0)
    meta, _ = eng.step(sched_out(req, ids, 0, len(tokens)))
    eng.forward(tokens, ids, 0)
    eng.finish_step(meta)
    eng.sched.request_finished(req)


def expected(eng: HybridEngine, tokens: list[int], layer: int, i: int) -> float:
    bs = eng.ident.block_size
    return float(torch.tensor(kv_value(tokens[: (i + 1) * bs], layer, 0), dtype=torch.float16))


TOKENS = list(range(1, 16 * 6 + 5))  # 6 full blocks and a partial one


def warm_request(node: FakeNode) -> tuple[HybridEngine, Any, tuple[int | None, bool], tuple[list[int], list[int]]]:
    """TOKENS computed by one engine, then asked for (and allocated) by a restarted one."""
    cold_run(HybridEngine(node), TOKENS)
    eng = HybridEngine(node)
    req = eng.request(TOKENS)
    answer = eng.sched.get_num_new_matched_tokens(req, 0)
    n = answer[0] or 0
    ids = eng.alloc(-(-len(TOKENS) // eng.ident.block_size), n // eng.ident.block_size)
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), n)
    return eng, req, answer, ids


def test_a_page_holds_every_layer_from_its_groups_block_and_loads_skip_the_null_block() -> None:
    ident = identity(layers=LAYERS)
    caches = hybrid_caches(ident, 8)
    layout = build_page_layout(caches, 8, GROUP_OF)
    assert layout.num_groups == 2 and layout.segment_groups == (0, 1, 0, 1)
    assert layout.page_bytes == ident.page_bytes  # the same page as with one group
    for i, name in enumerate(GROUP_OF):
        caches[name][3 if GROUP_OF[name] == 0 else 5].fill_(float(i + 1))
    pool = torch.zeros(layout.page_bytes * 2, dtype=torch.uint8)
    save_pages(layout.segments, [(3, 5)], pool, [0], layout.groups)
    assert torch.equal(pool[: layout.page_bytes], layout.page((3, 5)))
    with pytest.raises(ValueError, match="cannot be saved"):
        save_pages(layout.segments, [(3, -1)], pool, [layout.page_bytes], layout.groups)

    other = hybrid_caches(ident, 8)
    out = build_page_layout(other, 8, GROUP_OF)
    load_pages(out.segments, [(6, -1)], pool, [0], out.groups)  # the window left this block
    names = list(GROUP_OF)
    assert float(other[names[0]][6].flatten()[0]) == 1.0 and float(other[names[2]][6].flatten()[0]) == 3.0
    # Layers 1 and 3 (values 2 and 4 in the page) were skipped: they appear nowhere.
    values = {float(v) for t in other.values() for v in t.unique()}
    assert values == {0.0, 1.0, 3.0}, "a -1 group must not be written"


def test_a_restarted_hybrid_engine_loads_asynchronously_full_layers_and_the_window_only() -> None:
    node = FakeNode()
    bs = identity().block_size
    eng, req, (n, is_async), ids = warm_request(node)
    assert (n, is_async) == (6 * bs, True), "a multi-group hit must use vLLM's asynchronous load"
    empty = idle_step()
    meta, _ = eng.step(empty)  # the request waits for its KV; the load is issued in this step
    (ld,) = meta.loads
    assert ld.is_async and ld.block_ids[0] == (ids[0][0], -1) and ld.block_ids[5] == (ids[0][5], ids[1][5])
    eng.finish_step(meta)
    assert eng.worker.take_finished_recving() == {req.request_id}
    assert eng.worker.take_failed_recving() == set() and eng.worker.take_load_errors() == set()
    names = list(GROUP_OF)
    for i in range(6):
        for layer, name in enumerate(names):
            b = ids[GROUP_OF[name]][i]
            if b != NULL_BLOCK_ID:
                assert eng.value(name, b) == expected(eng, TOKENS, layer, i), (i, name)
    assert not eng.caches[names[1]][NULL_BLOCK_ID].any(), "the null block was written"
    assert not node.leases, "the load's lease was not released"


def test_a_block_some_group_no_longer_holds_is_not_saved() -> None:
    node = FakeNode()
    eng = HybridEngine(node)
    req = eng.request(TOKENS)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # A local prefix-cache hit of 4 blocks: the sliding-window group kept only the last 2.
    bs = eng.ident.block_size
    ids = eng.alloc(7, 4)
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), 0)
    meta, _ = eng.step(sched_out(req, ids, 4 * bs, len(TOKENS) - 4 * bs))
    eng.forward(TOKENS, ids, 4)
    eng.finish_step(meta)
    (sv,) = meta.saves
    (shard,) = sv.shards
    assert [p[0] for p in shard.block_ids] == ids[0][2:6], "blocks 0 and 1 lack their window layers' KV"
    assert all(-1 not in p for p in shard.block_ids)


def test_a_failed_multi_group_load_fails_the_request_not_block_ids() -> None:
    eng, req, _, ids = warm_request(FakeNode())
    def broken(*a: Any) -> None:
        raise OSError("copy failed")

    eng.worker._load_pages = broken  # type: ignore[method-assign]
    empty = idle_step()
    meta, _ = eng.step(empty)
    assert eng.worker.take_finished_recving() == {req.request_id}
    assert eng.worker.take_failed_recving() == {req.request_id}
    assert eng.worker.take_load_errors() == set(), "vLLM cannot map block ids of several groups to requests"


def test_a_promised_hit_vllm_did_not_allocate_for_releases_its_lease() -> None:
    node = FakeNode()
    cold_run(HybridEngine(node), TOKENS)
    eng = HybridEngine(node)
    req = eng.request(TOKENS)
    eng.sched.get_num_new_matched_tokens(req, 0)
    first = set(node.leases)
    assert first
    eng.sched.get_num_new_matched_tokens(req, 0)  # allocation failed; vLLM asks again
    assert not (first & node.leases), "the first answer's lease leaked"
    eng.sched.request_finished(req)
    assert not node.leases


def _vllm_config() -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, rank=0),
        model_config=SimpleNamespace(model="m", revision=None, dtype=torch.float16,
                                     hf_config=SimpleNamespace(to_dict=lambda: {"a": 1})),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout=None),
    )


def test_kv_identity_of_a_hybrid_model_equals_its_single_group_identity() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from pegaflow.connector.connector import kv_identity

    shape = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    names = list(GROUP_OF)
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(names, FullAttentionSpec(**shape))])
    two = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[0::2], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(names[1::2], SlidingWindowSpec(**shape, sliding_window=32)),
    ])
    assert kv_identity(_vllm_config(), two) == kv_identity(_vllm_config(), one)
    other = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[0::2], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(names[1::2], FullAttentionSpec(**{**shape, "head_size": 16})),
    ])
    with pytest.raises(ValueError, match="one shape"):
        kv_identity(_vllm_config(), other)
    mamba = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[0::2], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(names[1::2], MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float16,))),
    ])
    with pytest.raises(ValueError, match="mamba_cache_mode='align'"):  # no state at block boundaries
        kv_identity(_vllm_config(), mamba)
