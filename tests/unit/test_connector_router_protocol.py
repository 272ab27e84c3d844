"""The connector's side of the router protocol (pegaflow/core/router_protocol.py): it
describes itself when asked, reports what a prefill stored, and makes the decode half wait
(bounded) for those blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import xxhash

from pegaflow.connector import scheduler as scheduler_mod
from pegaflow.connector.settings import LOAD_ONLY, SAVE_ONLY, ConnectorSettings
from pegaflow.core.identity import block_hashes
from pegaflow.core.router_protocol import DESCRIBE_VERSION, ROUTER_KEY
from tests.unit.connector_fakes import Engine, FakeNode, identity

BS = identity().block_size


def prompt(seed: int, n: int = 5 * BS + 3) -> list[int]:
    return [(seed * 7919 + i) % 3000 + 1 for i in range(n)]


def test_a_request_without_router_params_gets_none_back() -> None:
    out = Engine(FakeNode(), identity()).run(prompt(1))
    assert out["finished"] == (False, None)


def test_the_description_lets_a_router_hash_like_the_engine() -> None:
    ident = identity()
    e = Engine(FakeNode(), ident)
    out = e.run(prompt(2), kv_transfer_params={ROUTER_KEY: {"describe": True}})
    delay, params = out["finished"]
    assert delay is False
    d = params[ROUTER_KEY]
    assert d["version"] == DESCRIBE_VERSION and d["node"] == "fake-node"
    assert (d["root"], d["block_size"], d["namespaces"], d["page_bytes"]) == (
        ident.root, ident.block_size, ident.namespaces, ident.page_bytes)
    # The router seeds the chain with the root as the engine does: same hashes as the node's.
    seed = xxhash.xxh3_128_digest(d["root"].encode())
    assert block_hashes(seed, prompt(2), d["block_size"]) == block_hashes(ident.seed, prompt(2), ident.block_size)
    assert d["prompt_blocks"] == d["stored_blocks"] == 5


def test_a_prefill_reports_every_full_prompt_block_it_stored() -> None:
    node = FakeNode()
    prefill = Engine(node, identity(), settings=ConnectorSettings(mode=SAVE_ONLY))
    _, params = prefill.run(prompt(3), kv_transfer_params={ROUTER_KEY: {"prefill": True}})["finished"]
    assert params[ROUTER_KEY]["stored_blocks"] == 5 == len(node.stored)
    # A load_only engine stores nothing, and says so.
    decode = Engine(node, identity(), settings=ConnectorSettings(mode=LOAD_ONLY))
    _, params = decode.run(prompt(4), kv_transfer_params={ROUTER_KEY: {}})["finished"]
    assert params[ROUTER_KEY]["stored_blocks"] == 0


@pytest.mark.parametrize("why", ["copy failed", "node down"])
def test_a_prefill_whose_saves_were_not_made_reports_none_stored(why: str) -> None:
    """The decode half waits (up to 2 s) for the blocks its prefill says it stored: a save
    that failed, or was never planned (the node down), must not be counted."""
    node = FakeNode()
    prefill = Engine(node, identity(), settings=ConnectorSettings(mode=SAVE_ONLY))
    if why == "copy failed":
        prefill.workers[0]._save_pages = lambda *args: (_ for _ in ()).throw(RuntimeError("copy failed"))
    else:
        node.up = False
    _, params = prefill.run(prompt(6), kv_transfer_params={ROUTER_KEY: {"prefill": True}})["finished"]
    assert not node.stored and params[ROUTER_KEY]["stored_blocks"] == 0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(scheduler_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_the_decode_half_waits_for_the_blocks_its_prefill_stored(clock: list[float]) -> None:
    node = FakeNode()
    p = prompt(5)
    Engine(node, identity()).run(p[: 3 * BS])  # 3 of the 5 blocks committed so far
    decode = Engine(node, identity(), settings=ConnectorSettings(mode=LOAD_ONLY))
    req = decode.request(p, kv_transfer_params={ROUTER_KEY: {"expect_blocks": 5}})
    assert decode.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert not node.leases, "a waiting request holds no lease"
    Engine(node, identity()).run(p)  # the rest of the prefill's commits land
    clock[0] += scheduler_mod.LOADING_POLL_S
    assert decode.sched.get_num_new_matched_tokens(req, 0) == (5 * BS, False)


def test_the_decode_half_recomputes_what_never_arrives(clock: list[float]) -> None:
    node = FakeNode()
    p = prompt(6)
    Engine(node, identity()).run(p[: 2 * BS])
    decode = Engine(node, identity(), settings=ConnectorSettings(mode=LOAD_ONLY))
    req = decode.request(p, kv_transfer_params={ROUTER_KEY: {"expect_blocks": 5}})
    for _ in range(3):
        assert decode.sched.get_num_new_matched_tokens(req, 0) == (None, False)
        clock[0] += scheduler_mod.LOADING_POLL_S
    clock[0] += scheduler_mod.LOADING_WAIT_S
    assert decode.sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)


@pytest.mark.parametrize("params", [{ROUTER_KEY: {"expect_blocks": "x"}}, {ROUTER_KEY: 3}, {"other": 1}, None])
def test_malformed_router_params_are_ignored(params: object) -> None:
    node = FakeNode()
    p = prompt(7)
    Engine(node, identity()).run(p[: 2 * BS])
    decode = Engine(node, identity())
    req = decode.request(p, kv_transfer_params=params)
    assert decode.sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)


def test_the_router_and_the_connector_hash_a_lora_request_alike() -> None:
    """The router learns each adapter's path from the engine's /v1/models (the card's root,
    vLLM's ``lora.path``); the connector from the request's LoRARequest."""
    from types import SimpleNamespace

    from pegaflow.connector.scheduler import extra_keys_of
    from pegaflow.core.identity import ExtraKeys
    from pegaflow.router.prompts import extra_keys

    adapters = {"sql": "/adapters/sql-v2"}
    routed = extra_keys({"model": "sql", "cache_salt": "t1"}, adapters)
    engine = extra_keys_of(SimpleNamespace(lora_request=SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v2"),
                                           cache_salt="t1", mm_features=[]))
    seed, tokens = identity().seed, prompt(7)
    assert block_hashes(seed, tokens, BS, routed) == block_hashes(seed, tokens, BS, engine)
    assert extra_keys({"model": "base-model"}, adapters) == ExtraKeys()
