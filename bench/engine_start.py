"""vLLM start-up time with PegaFlow, against the node's pool size.

    python bench/engine_start.py [--pools 1gb,16gb] [--rounds 2] [--after-prefault] [--summary F]

The pool lives in ``pegaflow-node``, not in the engine: an engine maps it lazily and
populates only what it copies, so its start must not grow with the pool (the original
reports vLLM ready 2.15x sooner than with the pool inside the engine). For each round and
each pool size a fresh node is started (left pre-faulting in the background, as in
production, or waited for with ``--after-prefault``), then two vLLM engines one after the
other (vLLM's default process layout): one with PegaKVConnector, and the same-run peer,
the same engine with no connector while the same node runs. The peer carries everything a
node of that size costs the host (memory the pool takes from the page cache, pre-fault
threads) without the connector, so the ratio is what the connector adds at that pool size.
Measured is the time from spawning the engine process to its ``LLM()`` being ready, and the
connector's own share of it: the worker's ``register_kv_caches`` (map the pool, register
the namespace), which it logs. Rounds interleave the configurations, so drift on the host
hits each alike; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.dirs import temp_dir_removed_at_exit  # noqa: E402
from tests.harness.engines import EngineProc  # noqa: E402
from tests.harness.models import build_tiny_llama  # noqa: E402
from tests.harness.node import Node  # noqa: E402

REGISTERED = re.compile(r"PegaFlow rank 0: .* registered in ([0-9.]+) ms")


def start_seconds(model: Path, logs: Path, node: Node, name: str, connector: bool) -> tuple[float, float | None]:
    """Seconds from spawn to ready, and (with the connector) its worker's registration in ms."""
    t0 = time.monotonic()
    eng = EngineProc(model, logs, node=node, connector="pega" if connector else "none", name=name,
                     multiprocess=True)
    took = time.monotonic() - t0
    log = eng.log_tail(10**7)
    eng.close()
    if not connector:
        return took, None
    m = REGISTERED.search(log)
    if m is None:
        raise SystemExit(f"error: no registration line in {eng.log_path}")
    return took, float(m.group(1))


def wait_prefaulted(node: Node, timeout: float = 600.0) -> None:
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
                    help="start the engines only once the node's pool is pre-faulted (a node up for a while)")
    ap.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    args = ap.parse_args()
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    if not pools or args.rounds < 1:
        raise SystemExit("error: --pools needs at least one size and --rounds at least 1")
    tmp = Path(temp_dir_removed_at_exit("pf-bench-start-"))
    logs = tmp / "logs"
    logs.mkdir()
    model = build_tiny_llama(tmp / "model", seed=0)
    pega: dict[str, list[float]] = {p: [] for p in pools}
    none: dict[str, list[float]] = {p: [] for p in pools}
    register_ms: dict[str, list[float]] = {p: [] for p in pools}
    ratios: dict[str, list[float]] = {p: [] for p in pools}
    for r in range(args.rounds):
        for p in pools:
            node = Node(logs, p, http=False).start()
            try:
                if args.after_prefault:
                    wait_prefaulted(node)
                # Alternate which engine goes first, so a node still pre-faulting slows each alike.
                order = (True, False) if r % 2 == 0 else (False, True)
                for with_connector in order:
                    took, reg = start_seconds(model, logs, node, f"{'pega' if with_connector else 'none'}-{p}-{r}",
                                              with_connector)
                    (pega if with_connector else none)[p].append(took)
                    if reg is not None:
                        register_ms[p].append(reg)
            finally:
                node.stop()
            ratios[p].append(pega[p][-1] / none[p][-1])
            print(f"round {r}, node pool {p}: PegaFlow {pega[p][-1]:.1f} s (registration {register_ms[p][-1]:.1f} ms),"
                  f" no connector {none[p][-1]:.1f} s", flush=True)
    med = statistics.median
    when = "after the node pre-faulted its pool" if args.after_prefault else "while the node pre-faults its pool"
    print(f"# vLLM ready after spawn (median of {args.rounds}), started {when}; logs in {logs}")
    for p in pools:
        print(f"node pool {p}: PegaFlow {med(pega[p]):.1f} s, no connector {med(none[p]):.1f} s "
              f"({med(ratios[p]):.2f}x, paired median); connector registration {med(register_ms[p]):.1f} ms")
    big, small = pools[-1], pools[0]
    print(f"largest / smallest pool: PegaFlow {med(pega[big]) / med(pega[small]):.2f}x, "
          f"no connector {med(none[big]) / med(none[small]):.2f}x; registration "
          f"{med(register_ms[big]) / med(register_ms[small]):.2f}x")
    if args.summary:
        args.summary.write_text(json.dumps({
            "pools": pools, "after_prefault": args.after_prefault,
            "pega_ready_s": {p: med(v) for p, v in pega.items()},
            "none_ready_s": {p: med(v) for p, v in none.items()},
            "register_ms": {p: med(v) for p, v in register_ms.items()},
            "pega_over_none": {p: med(v) for p, v in ratios.items()},
            "largest": {"pega_ready_s": med(pega[big]), "none_ready_s": med(none[big]),
                        "pega_over_none": med(ratios[big]), "register_ms": med(register_ms[big])},
            "runs": {"pega": pega, "none": none, "register_ms": register_ms},
        }))


if __name__ == "__main__":
    main()
