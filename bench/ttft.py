"""TTFT with and without an external KV cache: cold vs warm (cache filled, engine restarted).

Like the original's published run: 8 long prompts (~8K tokens), 1-token decode, one request
at a time, so TTFT is the time of one ``generate`` call. For each connector:

1. engine 1 (cold): a short warm-up request, then the 8 prompts (computed and saved);
2. engine 1 is shut down; engine 2 starts (the KV store keeps running);
3. engine 2 (warm): a short warm-up request, then the same 8 prompts (loaded).

Reports mean and p99 TTFT cold and warm, the speed-up, and the external hit tokens seen.

Connectors: ``pega`` (a ``pegaflow-node`` started here), ``example`` (vLLM's built-in
file-based ``ExampleConnector``, the baseline to beat) and ``none`` (no connector: warm =
cold, for reference). Peers that need their own environment (LMCache's multiprocess
server, Mooncake Store) are run with ``--peer-python`` pointing at a venv that has them
(never dependencies of PegaFlow); without it they are reported as not run.

The model is a locally built Llama (random weights, float16) sized so that a cold 8K
prefill takes >= 2 s on this machine.

    python bench/ttft.py --connectors pega,example,none --out docs/bench-ttft.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.harness import EngineProc, NodeProc  # noqa: E402
from tests.e2e.model import build_tiny_llama, make_text  # noqa: E402

# Sized so that a cold ~8K-token prefill takes >= 2 s on a 2-core CPU (float16 on CPU is slow:
# this 4-layer model already needs several seconds; a larger one makes the run take hours).
MODEL_SHAPE = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512)
PROMPT_TOKENS = 8000
NUM_PROMPTS = 8
MAX_MODEL_LEN = 8192 + 256


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def connector_args(name: str, tmp: Path) -> tuple[list[str], NodeProc | None]:
    if name == "none":
        return ["--connector", "none"], None
    if name == "pega":
        return ["--connector", "pega"], None  # node supplied by caller
    if name == "example":
        cfg = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example-kv")},
        }
        return ["--connector", "custom", "--kv-transfer-config", json.dumps(cfg)], None
    raise SystemExit(f"unknown connector {name!r}")


def run_phase(model: Path, logs: Path, args: list[str], node: NodeProc | None, prompts: list[list[int]], name: str,
              warmup: list[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    with EngineProc(model, logs, node=node, name=name, extra_args=[*args, "--max-model-len", str(MAX_MODEL_LEN)]) as eng:
        start_s = time.perf_counter() - t0
        eng.generate([warmup], 1)
        ttfts, cached = [], []
        for p in prompts:
            t = time.perf_counter()
            out = eng.generate([p], 1)[0]
            ttfts.append(time.perf_counter() - t)
            cached.append(out["num_cached_tokens"])
    return {"ttft_s": ttfts, "cached_tokens": cached, "engine_start_s": start_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default="pega,example,none")
    ap.add_argument("--prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/build the bench model here")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pf-ttft-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = args.model_dir or tmp / "model"
    if not (model / "config.json").exists():
        build_tiny_llama(model, seed=0, vocab=2000, max_pos=16384, **MODEL_SHAPE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for i in range(args.prompts):
        ids = tok(make_text(args.prompt_tokens * 2, 1000 + i))["input_ids"]
        prompts.append(list(ids[: args.prompt_tokens]))
    warmup = list(tok(make_text(200, 999))["input_ids"])

    results: dict[str, Any] = {
        "model": MODEL_SHAPE,
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "connectors": {},
    }
    for name in [c for c in args.connectors.split(",") if c]:
        extra, _ = connector_args(name, tmp)
        node = NodeProc(logs, pool_size="2gb") if name == "pega" else None
        try:
            cold = run_phase(model, logs, extra, node, prompts, f"{name}-cold", warmup)
            warm = run_phase(model, logs, extra, node, prompts, f"{name}-warm", warmup)
        finally:
            if node is not None:
                node.stop()
        row = {
            "cold_mean_ms": 1000 * statistics.mean(cold["ttft_s"]),
            "cold_p99_ms": 1000 * percentile(cold["ttft_s"], 99),
            "warm_mean_ms": 1000 * statistics.mean(warm["ttft_s"]),
            "warm_p99_ms": 1000 * percentile(warm["ttft_s"], 99),
            "warm_cached_tokens": warm["cached_tokens"],
            "cold": cold,
            "warm": warm,
        }
        row["speedup_mean"] = row["cold_mean_ms"] / row["warm_mean_ms"]
        results["connectors"][name] = row
        print(
            f"{name:10s} cold mean {row['cold_mean_ms']:8.1f} ms p99 {row['cold_p99_ms']:8.1f} ms | "
            f"warm mean {row['warm_mean_ms']:8.1f} ms p99 {row['warm_p99_ms']:8.1f} ms | "
            f"x{row['speedup_mean']:.1f} | cached {warm['cached_tokens']}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
