"""vLLM start-up time with PegaFlow, against the node's pool size.

    python bench/engine_start.py [--pools 1gb,16gb] [--rounds 2] [--summary F]

The pool lives in ``pegaflow-node``, not in the engine: an engine maps it lazily and
populates only what it copies, so its start must not grow with the pool (the original
reports vLLM ready 2.15x sooner than with the pool inside the engine). For each round and
each pool size a fresh node is started (and left pre-faulting in the background, as in
production), then a vLLM engine with PegaKVConnector; measured is the time from spawning
the engine process to its ``LLM()`` being ready. The same-run peer is the same engine with
no connector at all, started in the same rounds. Rounds interleave the configurations, so
drift on the host hits each alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.harness import EngineProc, NodeProc  # noqa: E402
from tests.e2e.model import build_tiny_llama  # noqa: E402


def start_seconds(model: Path, logs: Path, node: NodeProc | None, name: str) -> float:
    t0 = time.monotonic()
    eng = EngineProc(model, logs, node=node, connector="pega" if node is not None else "none", name=name)
    took = time.monotonic() - t0
    eng.close()
    return took


def wait_prefaulted(node: NodeProc, timeout: float = 600.0) -> None:
    from pegaflow.client import PegaClient

    deadline = time.monotonic() + timeout
    with PegaClient(node.addr, timeout=5.0) as c:
        while True:
            h = c.health()
            if h.pool_prefaulted_bytes >= h.pool_bytes:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"pool not pre-faulted after {timeout} s")
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", default="1gb,16gb", help="node pool sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--after-prefault", action="store_true",
                    help="start each engine only once the node's pool is pre-faulted (a node up for a while)")
    ap.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    args = ap.parse_args()
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="pf-bench-start-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = build_tiny_llama(tmp / "model", seed=0)
    runs: dict[str, list[float]] = {"none": [], **{p: [] for p in pools}}
    for r in range(args.rounds):
        runs["none"].append(start_seconds(model, logs, None, f"none-{r}"))
        print(f"round {r}: no connector {runs['none'][-1]:.1f} s", flush=True)
        for p in pools:
            node = NodeProc(logs, pool_size=p)
            if args.after_prefault:
                wait_prefaulted(node)
            try:
                runs[p].append(start_seconds(model, logs, node, f"pega-{p}-{r}"))
            finally:
                node.stop()
            print(f"round {r}: PegaFlow, {p} pool: {runs[p][-1]:.1f} s", flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    when = "after the node pre-faulted its pool" if args.after_prefault else "while the node pre-faults its pool"
    print(f"# vLLM ready after spawn (median of {args.rounds}), started {when}; logs in {logs}")
    print(f"no connector: {med['none']:.1f} s")
    for p in pools:
        print(f"PegaFlow, node pool {p}: {med[p]:.1f} s ({med[p] / med['none']:.2f}x no connector)")
    if len(pools) >= 2:
        print(f"largest / smallest pool: {med[pools[-1]] / med[pools[0]]:.2f}x")
    if args.summary:
        args.summary.write_text(json.dumps({
            "ready_s": med, "runs": runs, "pools": pools,
            "largest_over_smallest": med[pools[-1]] / med[pools[0]] if len(pools) >= 2 else 1.0,
        }))


if __name__ == "__main__":
    main()
