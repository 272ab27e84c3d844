"""Multi-turn conversations through two engines that take turns, with and without decode-block saves.

``--conversations`` (50) conversations of ``--turns`` (4) turns: turn 1 is a unique
~300-token message, every answer is ``--answer-tokens`` (256) tokens (greedy,
``ignore_eos``), and turn k+1's prompt is turn k's prompt, its answer and a new ~100-token
message. Engine A serves the odd turns and engine B the even ones, both with
PegaKVConnector on one ``pegaflow-node`` and vLLM's own prefix cache off, so every hit of a
turn is a block the other engine saved. A turn's requests go to its engine at once.

The workload runs twice: with ``pegaflow.save_decode_blocks`` on (the default) and off,
each in its own namespace (``pegaflow.model_id``). For each: prompt tokens, hit tokens (what
vLLM reports as cached), the token hit rate, and TTFT per turn (vLLM's
``first_token_latency``: arrival to first token, so a turn's requests queue behind each
other's prefills). Then ``pegaflow replay`` is given the trace the run implies (written to
the log folder: each request's queried blocks, and as ``saved`` the blocks the engine
stored beyond them) with the node's capacity, and its predicted token hit rate is compared
with the measured one (goal: within 1 pp, bench/goals.py).

    python bench/multiturn.py [--conversations 50 --turns 4 --answer-tokens 256] [--summary out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pegaflow.config.capacity import Capacity  # noqa: E402
from pegaflow.core.identity import block_hashes  # noqa: E402
from pegaflow.core.trace import encode_query, read_trace  # noqa: E402
from pegaflow.replay.model import Scenario  # noqa: E402
from pegaflow.replay.run import replay  # noqa: E402
from tests.harness.dirs import temp_dir_removed_at_exit  # noqa: E402
from tests.harness.engines import EngineProc, namespace_page_bytes  # noqa: E402
from tests.harness.models import build_tiny_llama, make_text  # noqa: E402
from tests.harness.node import Node  # noqa: E402

POOL = "1gb"
FIRST_TOKENS, MESSAGE_TOKENS = 300, 100
SEED = b"pegaflow-bench-multiturn"  # any seed: replay needs consistent block names, not the engine's


def kv_config(model_id: str, decode_saves: bool) -> str:
    return json.dumps({
        "kv_connector": "PegaKVConnector", "kv_role": "kv_both", "kv_connector_module_path": "pegaflow.connector",
        "kv_connector_extra_config": {"pegaflow.model_id": model_id,
                                      "pegaflow.save_decode_blocks": decode_saves},
    })


def run_config(model: Path, logs: Path, node: Node, decode_saves: bool, args: argparse.Namespace,
               firsts: list[list[int]], messages: list[list[list[int]]], warmup: list[list[int]]) -> dict[str, Any]:
    name = "decode-saves" if decode_saves else "prompt-only"
    extra = ["--connector", "custom", "--kv-transfer-config", kv_config(f"multiturn-{name}", decode_saves),
             "--max-model-len", str(FIRST_TOKENS + args.turns * (args.answer_tokens + MESSAGE_TOKENS) + 64)]
    t0 = time.perf_counter()
    engines = [EngineProc(model, logs, node=node, name=f"{name}-{x}", extra_args=extra, multiprocess=True)
               for x in "AB"]
    print(f"{name}: engines up in {time.perf_counter() - t0:.0f} s", flush=True)
    for e in engines:  # a first batch pays one-time costs; none of the measured turns should
        e.generate([w[:64] for w in warmup], 8)
    bs = engines[0].block_size
    prompts = [list(f) for f in firsts]
    turns: list[dict[str, Any]] = []
    requests: list[tuple[list[int], list[int]]] = []  # (prompt, answer) in serving order
    try:
        for k in range(args.turns):
            eng = engines[k % 2]
            outs = eng.generate(prompts, args.answer_tokens)
            turns.append({
                "prompt_tokens": sum(map(len, prompts)),
                "hit_tokens": sum(o["num_cached_tokens"] for o in outs),
                "mean_ttft_ms": 1000 * statistics.mean(o["ttft_s"] for o in outs),
            })
            print(f"{name}: turn {k + 1} on engine {'AB'[k % 2]}: hit {turns[-1]['hit_tokens']} of "
                  f"{turns[-1]['prompt_tokens']} prompt tokens, mean TTFT {turns[-1]['mean_ttft_ms']:.0f} ms",
                  flush=True)
            requests += [(p, o["tokens"]) for p, o in zip(prompts, outs, strict=True)]
            if k + 1 < args.turns:
                prompts = [p + o["tokens"] + messages[i][k] for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    finally:
        for e in engines:
            e.close()
    ns = next(n for n in node.stats().blocks_by_namespace if f"multiturn-{name}" in n)
    page = namespace_page_bytes(ns)
    # The trace this run implies: each request queries its full prompt blocks but the last
    # prompt token's; the engine then stores every full block it computed (prompt, and with
    # decode saves the answer's but its last token, whose KV is never computed).
    lines = []
    for i, (p, answer) in enumerate(requests):
        tokens = p + answer[:-1] if decode_saves else p
        full = block_hashes(SEED, tokens, bs)
        q = (len(p) - 1) // bs
        lines.append(encode_query(float(i), "multiturn", full[:q], page_bytes=page, block_tokens=bs, tokens=len(p),
                                  saved=full[q:]))
    trace_path = logs / f"{name}.trace.jsonl"
    trace_path.write_text("\n".join(lines) + "\n")
    res = replay(read_trace(lines), Scenario(Capacity.parse(POOL)))
    measured = sum(t["hit_tokens"] for t in turns) / sum(t["prompt_tokens"] for t in turns)
    predicted = res.hit_tokens / res.tokens
    print(f"{name}: token hit rate {100 * measured:.2f}% measured, {100 * predicted:.2f}% predicted by "
          f"pegaflow replay ({trace_path})", flush=True)
    return {"turns": turns, "hit_rate": measured, "replay_hit_rate": predicted,
            "hit_rate_error_pp": 100 * abs(measured - predicted), "block_size": bs, "trace": str(trace_path),
            "mean_ttft_ms_after_turn_1": statistics.mean(t["mean_ttft_ms"] for t in turns[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--summary", type=Path, default=None, help="write results as JSON")
    args = ap.parse_args()
    tmp = Path(temp_dir_removed_at_exit("pf-multiturn-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = build_tiny_llama(tmp / "model", seed=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)

    def text(n: int, seed: int) -> list[int]:
        return list(tok(make_text(n, seed))["input_ids"][:n])

    firsts = [text(FIRST_TOKENS, 5000 + c) for c in range(args.conversations)]
    warmup = [text(FIRST_TOKENS, 4000 + c) for c in range(8)]  # prompts no conversation shares
    messages = [[text(MESSAGE_TOKENS, 9000 + 100 * c + k) for k in range(args.turns)] for c in range(args.conversations)]
    node = Node(logs, POOL, http=False).start()
    try:
        results = {"conversations": args.conversations, "turns": args.turns, "answer_tokens": args.answer_tokens,
                   "pool": POOL}
        for decode_saves in (True, False):
            results["decode_saves" if decode_saves else "prompt_only"] = run_config(
                model, logs, node, decode_saves, args, firsts, messages, warmup)
    finally:
        node.stop()
    on, off = results["decode_saves"], results["prompt_only"]
    results["hit_rate_gain_pp"] = 100 * (on["hit_rate"] - off["hit_rate"])
    results["max_hit_rate_error_pp"] = max(on["hit_rate_error_pp"], off["hit_rate_error_pp"])
    print(f"decode-block saves: token hit rate {100 * on['hit_rate']:.1f}% vs {100 * off['hit_rate']:.1f}% "
          f"prompt blocks only; mean TTFT after turn 1 {on['mean_ttft_ms_after_turn_1']:.0f} ms vs "
          f"{off['mean_ttft_ms_after_turn_1']:.0f} ms; replay within {results['max_hit_rate_error_pp']:.2f} pp",
          flush=True)
    if args.summary:
        args.summary.write_text(json.dumps(results, indent=2))
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
