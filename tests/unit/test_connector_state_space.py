"""Hybrid state-space models (Mamba layers next to attention, vLLM's ``mamba_cache_mode="align"``).

The fake engine has four layers: 0 and 2 are state-space layers (group 0: per block, the
layer's state after that block, as a conv and an SSM tensor), 1 and 3 attend fully (group
1). As in vLLM's align mode, the engine hands off a state only where it keeps one (the
prompt's last full block, ``boundary_state_offloads``), and a request that resumes from
``n`` computed blocks holds a state-space block only at index ``n - 1``.
"""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pegaflow.connector import scheduler as scheduler_mod
from pegaflow.connector.layout import build_page_layout
from pegaflow.connector.scheduler import NULL_BLOCK_ID, SchedulerSide
from pegaflow.connector.worker import WorkerSide
from tests.unit.connector_fakes import FakeNode, fake_link, identity, kv_value

STATE, ATTN = 0, 1
GROUP_OF = {"model.layers.0.mixer": STATE, "model.layers.1.mixer.attn": ATTN,
            "model.layers.2.mixer": STATE, "model.layers.3.mixer.attn": ATTN}
CONV, SSM = (3, 8), (2, 4)  # per block: conv state float16, SSM state float32
STATE_BYTES = 2 * (CONV[0] * CONV[1] * 2 + SSM[0] * SSM[1] * 4)


def state_identity() -> Any:
    return dataclasses.replace(identity(layers=2), state_page_bytes=STATE_BYTES)


def caches(ident: Any, num_blocks: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, g in GROUP_OF.items():
        if g == ATTN:
            out[name] = torch.zeros(num_blocks, ident.num_kv_heads, ident.block_size, 2 * ident.head_size,
                                    dtype=torch.float16)
        else:
            out[name] = (torch.zeros(num_blocks, *CONV, dtype=torch.float16),
                         torch.zeros(num_blocks, *SSM, dtype=torch.float32))
    return out


class StateEngine:
    def __init__(self, node: FakeNode, num_blocks: int = 64) -> None:
        self.ident = state_identity()
        self.node = node
        ns = {n: self.ident.page_bytes for n in self.ident.namespaces}
        ns.update({n: self.ident.state_page_bytes for n in self.ident.state_namespaces})
        self.sched = SchedulerSide(self.ident, fake_link(node, ns), kv_groups=2, state_groups=frozenset({STATE}))
        self.worker = WorkerSide(self.ident, 0, lambda ns, pci: fake_link(node, ns, pci), kv_groups=2,
                                 state_groups=frozenset({STATE}))
        self.caches = caches(self.ident, num_blocks)
        self.worker.register_kv_caches(self.caches, num_blocks, GROUP_OF)
        self.free = list(range(num_blocks - 1, NULL_BLOCK_ID, -1))
        self.ids = itertools.count()

    def request(self, tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(request_id=f"s{next(self.ids)}", prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                               all_token_ids=list(tokens), lora_request=None, cache_salt=None, mm_features=[])

    def alloc(self, nblocks: int, computed_blocks: int) -> tuple[list[int], list[int]]:
        """Attention gets every block; the state-space group the null block below the block
        it resumes from (align mode)."""
        state = [NULL_BLOCK_ID if i < computed_blocks - 1 else self.free.pop() for i in range(nblocks)]
        return state, [self.free.pop() for _ in range(nblocks)]

    def forward(self, tokens: list[int], ids: tuple[list[int], list[int]], start_block: int) -> None:
        bs = self.ident.block_size
        for i in range(start_block, len(ids[0])):
            for layer, (name, g) in enumerate(GROUP_OF.items()):
                v = kv_value(tokens[: (i + 1) * bs], layer, 0)
                t = self.caches[name]
                if g == ATTN:
                    t[ids[ATTN][i]].fill_(v)
                elif ids[STATE][i] != NULL_BLOCK_ID:
                    t[0][ids[STATE][i]].fill_(v)
                    t[1][ids[STATE][i]].fill_(v)

    def state_value(self, layer: int, block: int) -> tuple[float, float]:
        conv, ssm = self.caches[list(GROUP_OF)[layer]]
        return float(conv[block].flatten()[0]), float(ssm[block].flatten()[0])


def sched_out(req: Any, ids: Any, computed: int, scheduled: int, offloads: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=ids, num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: scheduled},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offloads or {}),
    )


def idle_step() -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, kv_connector_block_state=None,
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                                                 resumed_req_ids=set()))


TOKENS = list(range(1, 16 * 6 + 5))  # 6 full blocks and a partial one


def cold_run(eng: StateEngine, tokens: list[int], state_at: tuple[int, ...] = (6,)) -> None:
    """Compute ``tokens``; vLLM hands off the states after the blocks in ``state_at``."""
    req = eng.request(tokens)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    bs = eng.ident.block_size
    ids = eng.alloc(-(-len(tokens) // bs), 0)
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), 0)
    offloads = {req.request_id: [(STATE, ids[STATE][n - 1], n * bs) for n in state_at]}
    meta = eng.sched.build_connector_meta(sched_out(req, ids, 0, len(tokens), offloads))
    eng.forward(tokens, ids, 0)
    eng.worker.save(meta)
    eng.sched.update_connector_output(eng.worker.report(meta))
    eng.sched.request_finished(req)


def warm(node: FakeNode) -> tuple[StateEngine, Any, tuple[int | None, bool], tuple[list[int], list[int]]]:
    eng = StateEngine(node)
    req = eng.request(TOKENS)
    answer = eng.sched.get_num_new_matched_tokens(req, 0)
    n = (answer[0] or 0) // eng.ident.block_size
    ids = eng.alloc(-(-len(TOKENS) // eng.ident.block_size), n)
    eng.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ids), (answer[0] or 0))
    return eng, req, answer, ids


def stored(node: FakeNode, namespaces: list[str]) -> int:
    return sum(1 for ns, _ in node.stored if ns in namespaces)


def test_state_layers_make_a_layout_of_their_own() -> None:
    ident = state_identity()
    c = caches(ident, 8)
    attn = build_page_layout(c, 8, {n: g for n, g in GROUP_OF.items() if g == ATTN}, num_groups=2)
    state = build_page_layout(c, 8, {n: g for n, g in GROUP_OF.items() if g == STATE}, num_groups=2)
    assert attn.page_bytes == ident.page_bytes and state.page_bytes == ident.state_page_bytes
    assert state.segment_groups == (STATE,) * 4 and attn.segment_groups == (ATTN, ATTN)  # conv + SSM per layer
    c["model.layers.2.mixer"][1][5].fill_(3.0)
    assert state.page((5, -1)).view(-1)[-16:].view(torch.float32).tolist() == [3.0] * 4  # the SSM state, unpadded


def test_a_cold_run_saves_attention_pages_and_only_the_handed_off_state() -> None:
    node = FakeNode()
    eng = StateEngine(node)
    cold_run(eng, TOKENS)
    assert stored(node, eng.ident.namespaces) == 6
    assert stored(node, eng.ident.state_namespaces) == 1, "one state: the one vLLM handed off"
    assert eng.worker.take_stats().get("saved_states") == 1


def test_a_restarted_engine_loads_the_attention_pages_and_the_state_at_the_hits_end() -> None:
    node = FakeNode()
    cold_run(StateEngine(node), TOKENS)
    eng, req, answer, ids = warm(node)
    bs = eng.ident.block_size
    assert answer == (6 * bs, True)
    meta = eng.sched.build_connector_meta(idle_step())
    state_ld = [ld for ld in meta.loads if ld.state]
    attn_ld = [ld for ld in meta.loads if not ld.state]
    assert len(state_ld) == 1 and len(attn_ld) == 1 and state_ld[0].is_async and attn_ld[0].is_async
    assert state_ld[0].block_ids == ((ids[STATE][5], -1),)
    eng.worker.start_load(meta)
    eng.sched.update_connector_output(eng.worker.report(meta))
    assert eng.worker.take_finished_recving() == {req.request_id}
    assert eng.worker.take_failed_recving() == set()
    for layer in (0, 2):
        want = float(torch.tensor(kv_value(TOKENS[: 6 * bs], layer, 0), dtype=torch.float16))
        assert eng.state_value(layer, ids[STATE][5]) == (want, pytest.approx(want, rel=1e-3))
    attn = eng.caches["model.layers.3.mixer.attn"]
    assert float(attn[ids[ATTN][2]].flatten()[0]) == float(
        torch.tensor(kv_value(TOKENS[: 3 * bs], 3, 0), dtype=torch.float16))
    assert eng.worker.take_stats().get("loaded_states") == 1
    assert not node.leases, "the attention or the state lease was not released"


def test_attention_pages_without_a_state_never_make_a_hit() -> None:
    node = FakeNode()
    cold_run(StateEngine(node), TOKENS, state_at=())
    eng, _req, answer, _ids = warm(node)
    assert stored(node, eng.ident.namespaces) == 6
    assert answer == (0, False), "a recurrent layer cannot resume without its state"
    assert not node.leases


def test_the_hit_ends_at_the_longest_prefix_with_a_state() -> None:
    node = FakeNode()
    cold_run(StateEngine(node), TOKENS, state_at=(4,))
    eng, _req, answer, ids = warm(node)
    assert answer == (4 * eng.ident.block_size, True)
    meta = eng.sched.build_connector_meta(idle_step())
    (state_ld,) = [ld for ld in meta.loads if ld.state]
    (attn_ld,) = [ld for ld in meta.loads if not ld.state]
    assert state_ld.block_ids == ((ids[STATE][3], -1),) and len(attn_ld.block_ids) == 4


def test_a_state_engine_waits_for_an_ssd_promotion_instead_of_promising_blocks() -> None:
    node = FakeNode()
    cold_run(StateEngine(node), TOKENS)
    node.loading, node.loading_expected = 1, 6
    eng = StateEngine(node)
    req = eng.request(TOKENS)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (None, False)


def test_a_state_page_being_promoted_is_waited_for_then_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]  # the scheduler's monotonic clock, advanced by hand
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    node = FakeNode()
    cold_run(StateEngine(node), TOKENS)
    node.loading, node.loading_match = 10**6, "|state="  # the state page is on SSD and never arrives
    eng = StateEngine(node)
    req = eng.request(TOKENS)
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert not node.leases, "the attention pages stay leased while the state is awaited"
    clock[0] += scheduler_mod.LOADING_WAIT_S
    assert eng.sched.get_num_new_matched_tokens(req, 0) == (0, False), "waited past LOADING_WAIT_S"
    assert not node.leases


def test_generated_blocks_are_not_saved_by_a_state_engine() -> None:
    """vLLM keeps no state at a generated block's end, so such a block could never end a hit."""
    node = FakeNode()
    eng = StateEngine(node)
    req = eng.request(TOKENS)
    eng.sched.get_num_new_matched_tokens(req, 0)
    st = eng.sched._reqs[req.request_id]
    req.all_token_ids = TOKENS + list(range(40))  # decoded two more blocks' worth
    assert eng.sched._known_hashes(st, 9) == 6


def test_kv_identity_of_a_hybrid_state_space_model() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from pegaflow.connector.connector import kv_identity
    from tests.unit.test_connector_hybrid import _vllm_config

    shape = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    names = list(GROUP_OF)

    def config(mode: str) -> Any:
        mamba = MambaSpec(block_size=16, shapes=(CONV, SSM), dtypes=(torch.float16, torch.float32),
                          mamba_cache_mode=mode, page_size_padded=4096)
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(names[0::2], mamba), KVCacheGroupSpec(names[1::2], FullAttentionSpec(**shape))])

    ident = kv_identity(_vllm_config(), config("align"))
    assert ident.state_page_bytes == STATE_BYTES, "the states, without vLLM's padding"
    assert ident.page_bytes == state_identity().page_bytes and ident.num_layers == 2
    assert ident.state_namespaces == [f"{ident.namespaces[0]}|state={STATE_BYTES}"]
    with pytest.raises(ValueError, match="mamba_cache_mode='align'"):
        kv_identity(_vllm_config(), config("none"))
