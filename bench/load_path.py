"""Warm TTFT of a DRAM hit: the synchronous load path against the asynchronous one.

PegaKVConnector copies a hit on blocks already in the node's DRAM synchronously, before
the step's forward, and uses vLLM's asynchronous load (``(n, True)`` + ``get_finished``)
for blocks still on their way (SSD, peers), and for every hit of an engine with several KV
cache groups (vLLM cannot fail one block of several groups). That asynchronous path costs
one engine step more per hit; this measures what that step costs in TTFT.

The same sliding-window model (odd layers attend over ``--window`` tokens) runs with
vLLM's hybrid KV cache manager off (one KV cache group: the synchronous path) and on (two
groups: the asynchronous path). Pages are the same bytes either way (one namespace), so
one cold engine fills the node and both warm engines hit the same pages. The warm engines
run side by side and get the prompts in turn (rotating which goes first).

    python bench/load_path.py [--prompts 8 --prompt-tokens 8000] [--summary out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.ttft import MAX_MODEL_LEN, MODEL_SHAPE, PAUSE_S, percentile, ttft  # noqa: E402
from tests.harness.dirs import temp_dir_removed_at_exit  # noqa: E402
from tests.harness.engines import EngineProc  # noqa: E402
from tests.harness.models import build_tiny_llama, make_text  # noqa: E402
from tests.harness.node import Node  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--window", type=int, default=1024, help="tokens a sliding-window layer attends over")
    ap.add_argument("--summary", type=Path, default=None, help="write results as JSON")
    args = ap.parse_args()
    tmp = Path(temp_dir_removed_at_exit("pf-loadpath-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = build_tiny_llama(tmp / "model", seed=0, vocab=2000, max_pos=16384, sliding_window=args.window,
                             **MODEL_SHAPE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [list(tok(make_text(args.prompt_tokens * 2, 7000 + i))["input_ids"][: args.prompt_tokens])
               for i in range(args.prompts)]
    warmup = list(tok(make_text(200, 6999))["input_ids"])
    common = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(MAX_MODEL_LEN)]
    variants = {"sync (1 group)": ["--no-hybrid-kv-cache"], "async (2 groups)": []}
    node = Node(logs, "2gb", http=False).start()
    engines: dict[str, EngineProc] = {}
    results: dict[str, object] = {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                                  "window": args.window}
    try:
        with EngineProc(model, logs, node=node, name="cold", extra_args=[*common, "--no-hybrid-kv-cache"],
                        multiprocess=True) as cold:
            cold.generate(prompts, 1)
        for name, extra in variants.items():
            engines[name] = EngineProc(model, logs, node=node, name=name.split()[0], extra_args=[*common, *extra],
                                       multiprocess=True)
            engines[name].generate([warmup], 1)
        times: dict[str, list[float]] = {n: [] for n in engines}
        cached: dict[str, list[int]] = {n: [] for n in engines}
        names = list(engines)
        for i, p in enumerate(prompts):
            for name in names[i % 2:] + names[: i % 2]:
                time.sleep(PAUSE_S)
                t, c = ttft(engines[name], p)
                times[name].append(t)
                cached[name].append(c)
        hybrid = {n: e.hybrid_kv_cache for n, e in engines.items()}
        async_loads = {n: e.metrics().get("vllm:pegaflow_async_loads", 0) for n, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
        node.stop()
    for name in names:
        results[name] = {"mean_ms": 1000 * statistics.mean(times[name]), "p99_ms": 1000 * percentile(times[name], 99),
                         "cached_tokens": cached[name], "hybrid_kv_cache": hybrid[name],
                         "async_loads": async_loads[name]}
        r = results[name]
        print(f"{name:18s} warm mean {r['mean_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  "  # type: ignore[index]
              f"async loads {async_loads[name]:.0f}  cached {cached[name]}", flush=True)
    ratios = [a / s for a, s in zip(times[names[1]], times[names[0]], strict=True)]
    results["async_over_sync_median"] = statistics.median(ratios)
    print(f"async / sync, paired median: x{results['async_over_sync_median']:.3f}", flush=True)
    if args.summary:
        args.summary.write_text(json.dumps(results, indent=2))
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
