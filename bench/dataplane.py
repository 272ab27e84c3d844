"""The data path with the node's background work off and on, the foreground held constant.

    python bench/dataplane.py [--seconds 12] [--rounds 2] [--engines 2] [--rate 40] [--parts A,B] [--summary F]

Foreground, the same in both modes: ``--engines`` engine client processes (bench.dataplane's
:class:`Engine` workers, :class:`pegaflow.client.PegaClient` over the node's local socket,
the connector's calls) each run an open loop at ``--rate`` requests/s: a Query with a lease
and a fresh ``req_id`` of a 64-block prefix the engines share (resident: every Query touches it),
its Release, and every ``--save-every``-th request a Reserve + Commit of 64 new blocks
(256 KiB pages).
No page is copied: the calls are what is measured (bench/saturation.py copies).

Background, switched as a whole:

- off: no SSD tier, a pool large enough that nothing is evicted in the window, no Redis,
  no scraper, no Stats caller, and the ceiling at its smallest (one window, 4-bit HLL
  buckets: the node has no switch to turn it off; its per-Query ``observe`` runs in both).
- on: an SSD tier on ``--dir`` writing behind every commit, a pool small enough that L1
  evicts all the time, block events published to a real redis-server (with the ceiling's
  sketch every second; a node with ``--redis-url`` is in a cluster, so it also hashes every
  committed page for its peers), ``--scrapers`` threads each scraping ``/metrics`` once a second,
  ``Stats`` once a second, and the ceiling at its defaults (3 windows, 16-bit buckets,
  refreshed every 5 s).

``--parts ssd,scrape`` switches on only those parts (attribution: what each costs the data
path alone); the default is all of them. ``--parts none`` leaves the background off in both
modes: an A/A run, whose on/off ratios are what this host's noise alone gives them.

Modes alternate (off, on, off, on, ...; a fresh node each), so both see the same phases of
the host. Reported per mode: p50/p99/p999 of each call (client side, the call alone, not
the open loop's lag), the node's CPU per call (utime + stime over the window / calls), and
what the background did in the window, read from the node's metrics (bytes written to
SSD, L1 evictions, events published) and the scrapers' own count (the node does not count
scrapes), and the node's event-loop lag (``pegaflow_node_event_loop_lag_seconds``: how late
the loop that answers engines ran a timer, whatever held it). The run fails when the
background did nothing in an "on" window, so a quiet window cannot pass for a loaded one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import cpu_seconds, scrape  # noqa: E402
from tests.harness import wait_until  # noqa: E402
from tests.harness.node import Node  # noqa: E402
from tests.harness.redis import RedisServer, start_server  # noqa: E402

BLOCKS = 64
NS = "dataplane"
CALLS = ("query", "release", "reserve", "commit")
# The background, part by part (--parts): the SSD write-behind, L1 eviction (a pool that
# must evict), Redis (block events, the ceiling's sketch publications, peer checksums),
# /metrics scrapers, Stats calls, the ceiling at its defaults.
PARTS = ("ssd", "evict", "redis", "scrape", "stats", "ceiling")
PERCENTILES = {"p50": 50.0, "p99": 99.0, "p999": 99.9}


# ---- the engine worker: one engine's calls, in a process of its own --------------------------
COPIES = ("none", "cpu", "dma")  # a round's page copies: skipped, on the calling thread, on the DMA thread


def dma_thread() -> None:
    """The initializer of an engine worker's copy thread, the stand-in for a GPU engine's copy
    engine: ``SCHED_IDLE``, so the copy (and the second thread the native kernel starts, which
    inherits the policy) runs on CPU time no other thread of the host wants, and a thread
    woken by the node's answer preempts it at once, as DMA takes no CPU from the engine's
    threads. The bytes are still copied into the pool by the CPU, memory bandwidth and all."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def engine_worker(addr: str, spaces: list[tuple[str, int, int]]) -> None:
    """Register the namespaces ``spaces`` ((name, page KiB, layers) each) and serve rounds
    read from stdin (one JSON line each: ns, rate, seconds, start (wall clock), save_every,
    copy: one of ``COPIES``); answer each with one JSON line of per-call latencies and the
    bytes copied (and under which scheduling policy). Prints "ready" once registered and its
    namespaces' shared prefixes are committed."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from pegaflow.client import PegaClient, save_pages

    copier = ThreadPoolExecutor(1, thread_name_prefix="dma", initializer=dma_thread)
    dma_policy = copier.submit(os.sched_getscheduler, 0).result()  # the initializer ran (or raised here)
    c = PegaClient(addr, timeout=30)
    c.register({name: kib << 10 for name, kib, _ in spaces})
    caches: dict[str, list] = {}
    prefixes: dict[str, list[bytes]] = {}
    for name, kib, layers in spaces:
        heads = max(1, (kib << 10) // layers // (128 * 128 * 2))
        buf = torch.randn(layers, 2 * BLOCKS, heads, 128, 128).to(torch.float16)
        kv = caches[name] = [buf[i] for i in range(layers)]
        # One prefix all engines share (a system prompt): queried by every request, so it
        # stays resident however much the others' saves evict.
        prefixes[name] = [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest() for i in range(BLOCKS)]

    def ensure_prefix(ns: str) -> None:
        """Save what is missing of ``ns``'s shared prefix (another namespace's round may have
        evicted it); blocks another engine saves meanwhile are skipped."""
        r = c.reserve(ns, prefixes[ns])
        ok = [i for i, o in enumerate(r.offsets) if o >= 0]
        if ok:
            save_pages(caches[ns], ok, r.pool, [r.offsets[i] for i in ok])
        if r.reservation_id:
            c.commit(r.reservation_id)

    for name, _, _ in spaces:
        ensure_prefix(name)
    print("ready", flush=True)
    tag = f"{os.getpid()}-"
    seq = 0
    for line in sys.stdin:
        job = json.loads(line)
        ns = job["ns"]
        kv, hot = caches[ns], prefixes[ns]
        ensure_prefix(ns)
        rate, seconds, start = float(job["rate"]), float(job["seconds"]), float(job["start"])
        save_every, copy = int(job.get("save_every", 1)), str(job.get("copy", "none"))
        copied = 0
        # The connector sends its Commits and Releases without waiting for the answer
        # (wait=False: pegaflow/connector/scheduler.py); wait=True times the node's answer.
        wait = bool(job.get("wait", True))
        lat: dict[str, list[float]] = {k: [] for k in CALLS}
        misses = late = n = 0
        start += float(job.get("phase", 0.0)) / rate  # engines are not in step with each other
        while time.time() < start:
            time.sleep(min(0.01, max(0.0, start - time.time())))
        t_start = time.monotonic()
        while True:
            due = t_start + n / rate  # open loop: request n starts at its time, or at once if late
            now = time.monotonic()
            if due >= t_start + seconds:
                break
            if due > now:
                time.sleep(due - now)
            elif now - due > 1.0 / rate:
                late += 1
            seq += 1
            t0 = time.perf_counter()
            q = c.query([ns], hot, req_id=tag + str(seq))
            t1 = time.perf_counter()
            lat["query"].append(t1 - t0)
            misses += q.hit_blocks < BLOCKS
            if n % save_every == 0:
                fresh = [os.urandom(16) for _ in range(BLOCKS)]
                t0 = time.perf_counter()
                res = c.reserve(ns, fresh)
                t1 = time.perf_counter()
                lat["reserve"].append(t1 - t0)
                ok = [i for i, o in enumerate(res.offsets) if o >= 0] if copy != "none" else []
                if ok:
                    pages = (kv, [BLOCKS + i for i in ok], res.pool, [res.offsets[i] for i in ok])
                    # "dma": the caller waits for the copy thread, as the connector waits for
                    # its save; only the copy runs below the engine's own threads.
                    copied += copier.submit(save_pages, *pages).result() if copy == "dma" else save_pages(*pages)
                t0 = time.perf_counter()
                c.commit(res.reservation_id, wait=wait)
                lat["commit"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c.release(q.lease_id, wait=wait)
            lat["release"].append(time.perf_counter() - t0)
            n += 1
        took = time.monotonic() - t_start  # > seconds when the client fell behind
        print(json.dumps({"lat": lat, "requests": n, "seconds": took, "late": late, "misses": misses,
                          "copied_bytes": copied, "copy_policy": dma_policy if copy == "dma" else os.sched_getscheduler(0)}),
              flush=True)
    c.close()
    copier.shutdown()


@dataclass
class Engines:
    """``count`` engine workers on one node, driven round by round; each registers every
    namespace of ``spaces`` ((name, page KiB, layers) each), a round names one."""

    addr: str
    count: int
    spaces: list[tuple[str, int, int]]
    log: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> Engines:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as log:  # the clients' own logs (registered, copy kernels)
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--engine-worker", self.addr,
                     *(f"{n}:{k}:{la}" for n, k, la in self.spaces)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env))
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"engine worker {p.pid} did not start (exit {p.poll()}): {line!r}; "
                                   f"{self.log.read_text()[-1500:]}")
        return self

    def start(self, ns: str, rate: float, seconds: float, save_every: int = 1, copy: str = "none",
              delay: float = 0.3, wait: bool = True) -> float:
        """Start one round on every worker (``delay`` from now; returns that moment). Worker i
        is shifted by i/count of a request interval: engines in step would send their requests
        in bursts, which real engines do not (8 clients in step, 256 KiB pages: Query p99 ~20 ms at
        32 requests/s, a tenth of the saturating rate; shifted, 1.9 ms on a busier host)."""
        if copy not in COPIES:
            raise ValueError(f"copy must be one of {COPIES}, got {copy!r}")
        at = time.time() + delay
        for i, p in enumerate(self.procs):
            assert p.stdin is not None
            p.stdin.write(json.dumps({"ns": ns, "rate": rate, "seconds": seconds, "start": at, "phase": i / self.count,
                                      "save_every": save_every, "copy": copy, "wait": wait}) + "\n")
            p.stdin.flush()
        return at

    def results(self) -> list[dict]:
        out = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"engine worker {p.pid} exited {p.wait()}: {self.log.read_text()[-1500:]}")
            out.append(json.loads(line))
        return out

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50/p99/p999 in µs (NaN-free: an empty list gives zeros and ``n`` 0)."""
    if not xs:
        return {"n": 0, **dict.fromkeys(PERCENTILES, 0.0)}
    a = np.asarray(xs) * 1e6
    return {"n": len(xs), **{k: float(np.percentile(a, q)) for k, q in PERCENTILES.items()}}


def merge(results: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in CALLS}
    for r in results:
        for k in CALLS:
            out[k] += r["lat"].get(k, [])
    return out


# ---- background load: scrapers and a Stats caller, in this process's threads ------------------
class Background:
    """``scrapers`` threads each GET /metrics once a second, and one thread calls Stats once a
    second, until stopped; each counts what succeeded."""

    def __init__(self, http_port: int, addr: str, scrapers: int, stats: bool = True) -> None:
        self.http_port, self.addr = http_port, addr
        self.stop_ev = threading.Event()
        self.scrapes = 0
        self.stats_calls = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.scrapers, self.stats = scrapers, int(stats)
        self.threads = [threading.Thread(target=self._scrape, daemon=True) for _ in range(scrapers)]
        if stats:
            self.threads.append(threading.Thread(target=self._stats, daemon=True))

    def _every_second(self, fn: Callable[[], None]) -> None:
        nxt = time.monotonic()
        while not self.stop_ev.is_set():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - counted and shown; the window then fails as quiet
                with self.lock:
                    self.errors.append(repr(exc))
            nxt += 1.0
            self.stop_ev.wait(max(0.0, nxt - time.monotonic()))

    def _scrape(self) -> None:
        url = f"http://127.0.0.1:{self.http_port}/metrics"

        def once() -> None:
            body = urllib.request.urlopen(url, timeout=5).read()
            if b"pegaflow_node_rpc_duration_seconds" in body:
                with self.lock:
                    self.scrapes += 1

        self._every_second(once)

    def _stats(self) -> None:
        from pegaflow.client import PegaClient

        c = PegaClient(self.addr, timeout=10)

        def once() -> None:
            c.stats()
            with self.lock:
                self.stats_calls += 1

        self._every_second(once)
        c.close()

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        # Until every thread has done its work once (the Stats client's first call takes
        # seconds on a busy host), so the window sees the background's steady state.
        wait_until(lambda: self.stats_calls >= self.stats and self.scrapes >= self.scrapers, 60,
                   "every background thread's first scrape / Stats call", every=0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_ev.set()
        for t in self.threads:
            t.join(timeout=10)


def start_redis(tmp: Path) -> RedisServer:
    """A redis-server of infra/redis/ on a free port (tests/harness/redis.py)."""
    if not shutil.which("redis-server"):
        raise SystemExit("dataplane: redis-server is not installed (Debian package redis-server)")
    return start_server(tmp)


def profile(args: argparse.Namespace, pid: int, mode: str) -> subprocess.Popen | None:
    """With ``--py-spy``: sample the node for the window, only threads holding the GIL, per
    thread, as collapsed stacks in ``--profile-dir``/MODE-<pid>.txt (non-blocking: the node
    is not paused to be read)."""
    if not args.py_spy:
        return None
    args.profile_dir.mkdir(parents=True, exist_ok=True)
    out = args.profile_dir / f"{mode}-{pid}.txt"
    return subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-d", str(int(args.seconds)), "-r", "500",
                             "-f", "raw", "--threads", "--gil", "--nonblocking", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---- one window of one mode --------------------------------------------------------------------
def window(args: argparse.Namespace, on: bool, tmp: Path, redis_url: str) -> dict:
    page = args.page_kib << 10
    per_engine = args.rate * (args.seconds + 2) / args.save_every + 2  # requests that save, + margin
    written = int((args.engines * per_engine + 1) * BLOCKS * page)  # the shared prefix included
    extra = ["--log-level", "warning"]
    parts = set(args.parts) if on else set()
    ssd_dir = None
    if "ssd" in parts:
        ssd_dir = Path(tempfile.mkdtemp(prefix="pf-bench-dataplane-", dir=args.dir))
        extra += ["--ssd-cache-path", str(ssd_dir / "cache"), "--ssd-cache-capacity", f"{args.ssd_mb}mb"]
    if "redis" in parts:
        extra += ["--redis-url", redis_url, "--node-id", f"dataplane-{os.getpid()}", "--ceiling-publish-interval", "1"]
    # nothing evicted in the window unless eviction is on
    pool_mb = args.pool_mb if "evict" in parts else int(written * 1.25) >> 20
    if "ceiling" not in parts:
        extra += ["--ceiling-windows", "1h", "--metric-hll-bucket-bits", "4"]
    node = Node(tmp, f"{pool_mb}mb", extra=extra)  # the node's defaults
    node.start(timeout=120)
    try:
        with Engines(node.addr, args.engines, [(NS, args.page_kib, args.layers)], tmp / "engines.log") as eng:
            # Warm-up round (not timed): the workers' first calls, the node's first evictions.
            eng.start(NS, args.rate, min(2.0, args.seconds), args.save_every)
            eng.results()
            bg = Background(node.http_port, node.addr, args.scrapers if "scrape" in parts else 0,
                            stats="stats" in parts)
            if parts & {"scrape", "stats"}:
                bg.__enter__()
            try:
                at = eng.start(NS, args.rate, args.seconds, args.save_every)
                time.sleep(max(0.0, at - time.time()))
                before = scrape(node.http_port)
                scrapes0, stats0 = bg.scrapes, bg.stats_calls
                cpu0, t0 = cpu_seconds(node.proc.pid), time.monotonic()
                spy = profile(args, node.proc.pid, "on" if on else "off")
                res = eng.results()
                if spy is not None:
                    spy.wait(timeout=args.seconds + 60)
                cpu, took = cpu_seconds(node.proc.pid) - cpu0, time.monotonic() - t0
                if parts & {"scrape", "stats"}:
                    # A scrape or Stats call in flight when the window closes ran during it:
                    # wait (bounded) for it to land, so a short window on a loaded host does
                    # not read a background that ran as quiet (seen with 2 s windows).
                    with contextlib.suppress(AssertionError):  # still none: reported below as quiet
                        wait_until(lambda: bg.scrapes - scrapes0 >= bg.scrapers and bg.stats_calls - stats0 >= bg.stats,
                                   30, "the window's scrapes / Stats calls to land", every=0.05)
                scrapes, stats_calls = bg.scrapes - scrapes0, bg.stats_calls - stats0
                after = scrape(node.http_port)
            finally:
                if parts & {"scrape", "stats"}:
                    bg.__exit__()
    finally:
        node.stop()
        if ssd_dir is not None:
            shutil.rmtree(ssd_dir, ignore_errors=True)

    def delta(prefix: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k == prefix or k.startswith(prefix + "|"))

    def node_p99(method: str) -> float:
        """p99 of the node's own handler time for ``method`` (local socket) in the window: the
        upper bound of its histogram bucket, µs (what the node did, without the transport and
        the scheduling of either process)."""
        pre = "pegaflow_node_rpc_duration_seconds_bucket|le="
        buckets = sorted((float(k[len(pre):].split("|")[0]), v - before.get(k, 0.0)) for k, v in after.items()
                         if k.startswith(pre) and f"|method={method}|" in k and "|status=OK|" in k
                         and k.endswith("|transport=local"))
        return bucket_p99(buckets)

    def bucket_p99(buckets: list[tuple[float, float]]) -> float:
        total = buckets[-1][1] if buckets else 0.0
        return next((le * 1e6 for le, n in buckets if total and n >= 0.99 * total), 0.0)

    def lag_p99() -> float:
        """p99 of the node's event-loop lag in the window (bucket bound, µs): how late the loop
        that answers engines ran what was due, whatever held it."""
        pre = "pegaflow_node_event_loop_lag_seconds_bucket|le="
        return bucket_p99(sorted((float(k[len(pre):].split("|")[0]), v - before.get(k, 0.0))
                                 for k, v in after.items() if k.startswith(pre)))

    lat = merge(res)
    calls = sum(len(v) for v in lat.values())
    return {
        "node_p99_us": {k: node_p99(k.capitalize()) for k in CALLS},
        "lat": lat,
        "calls": calls,
        "seconds": took,
        "requests_per_s": sum(r["requests"] for r in res) / max(args.seconds, *(r["seconds"] for r in res)),
        "late": sum(r["late"] for r in res),
        "misses": sum(r["misses"] for r in res),
        "node_cpu_s": cpu,
        "background": {
            "ssd_written_bytes": delta("pegaflow_node_ssd_write_bytes_total"),
            "l1_evicted_blocks": delta("pegaflow_node_evictions_total|tier=l1"),
            "events_published_blocks": delta("pegaflow_node_events_published_blocks_total"),
            "sketches_published": delta("pegaflow_node_ceiling_sketch_publications_total|result=ok"),
            "scrapes": scrapes,
            "stats_calls": stats_calls,
        },
        "background_errors": bg.errors[:5],
        # the node's garbage collections in the window, by generation: a collection pauses the
        # loop too, so the tail may be GC rather than background work
        "loop_lag": {"samples": delta("pegaflow_node_event_loop_lag_seconds_count"),
                     "seconds": delta("pegaflow_node_event_loop_lag_seconds_sum"), "p99_us": lag_p99()},
        "gc": {g: {"collections": delta(f"pegaflow_node_gc_pause_seconds_count|generation={g}"),
                   "seconds": delta(f"pegaflow_node_gc_pause_seconds_sum|generation={g}")} for g in "012"},
    }


def summarize(windows: list[dict]) -> dict:
    lat = {k: [x for w in windows for x in w["lat"][k]] for k in CALLS}
    calls = sum(w["calls"] for w in windows)
    bg: dict[str, float] = {}
    for w in windows:
        for k, v in w["background"].items():
            bg[k] = bg.get(k, 0) + v
    return {
        "calls": {k: percentiles(v) for k, v in lat.items()},
        "node_cpu_us_per_call": sum(w["node_cpu_s"] for w in windows) / max(1, calls) * 1e6,
        # the worst window's (histogram buckets do not merge into a percentile across nodes)
        "node_p99_us": {k: max(w["node_p99_us"][k] for w in windows) for k in CALLS},
        "requests_per_s": float(np.mean([w["requests_per_s"] for w in windows])),
        "late_requests": sum(w["late"] for w in windows),
        "query_misses": sum(w["misses"] for w in windows),
        "background": bg,
        "gc": {g: {k: sum(w["gc"][g][k] for w in windows) for k in ("collections", "seconds")} for g in "012"},
        # the node's event loop, sampled every 100 ms: mean lag over all windows, worst window's p99
        "loop_lag_mean_us": sum(w["loop_lag"]["seconds"] for w in windows)
        / max(1.0, sum(w["loop_lag"]["samples"] for w in windows)) * 1e6,
        "loop_lag_p99_us": max(w["loop_lag"]["p99_us"] for w in windows),
    }


# What each part of the background does that the window counts (each must be > 0 when on).
DID = {"ssd": "ssd_written_bytes", "evict": "l1_evicted_blocks", "redis": "events_published_blocks",
       "scrape": "scrapes", "stats": "stats_calls"}


def quiet(on: dict, parts: list[str]) -> list[str]:
    """What the background's parts ``parts`` did not do in the "on" windows."""
    return [DID[p] for p in parts if p in DID and not on["background"][DID[p]] > 0]


def parse_parts(text: str) -> list[str]:
    if text == "none":  # an A/A run: both modes off
        return []
    parts = [p for p in text.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"unknown part {','.join(bad)!r}: one or more of {','.join(PARTS)}")
    return parts


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-worker":
        engine_worker(sys.argv[2], [(n, int(k), int(la)) for n, k, la in (x.split(":") for x in sys.argv[3:])])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window of each mode, per round")
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    ap.add_argument("--engines", type=int, default=2, help="engine client processes")
    ap.add_argument("--rate", type=float, default=40.0, help="requests/s of each engine (open loop)")
    ap.add_argument("--save-every", type=int, default=8, help="every N-th request also saves 64 new blocks")
    # 256 KiB, the smaller of the issue's page sizes. Not smaller: python-xxhash keeps the GIL
    # while it hashes a small buffer (64 KiB: a hashing thread halved another thread's
    # progress; 256 KiB: no effect), so smaller pages make the node's checksums compete with
    # its event loop, a cost of small pages rather than of background work.
    ap.add_argument("--page-kib", type=int, default=256, help="page size of the namespace")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pool-mb", type=int, default=64, help="the pool with the background on (must evict)")
    ap.add_argument("--ssd-mb", type=int, default=1024)
    ap.add_argument("--scrapers", type=int, default=4, help="/metrics scrapers at 1/s each (background on)")
    ap.add_argument("--parts", type=parse_parts, default=list(PARTS), metavar="A,B",
                    help=f"the background parts switched on in the 'on' windows (attribution), of {','.join(PARTS)}; "
                    "none: both modes off (A/A)")
    ap.add_argument("--dir", default="/var/tmp", help="file system for the SSD tier's file")
    ap.add_argument("--py-spy", default="", metavar="PATH",
                    help="py-spy binary: record where the node's GIL time goes in each window (not installed "
                         "with PegaFlow; pip download py-spy)")
    ap.add_argument("--profile-dir", type=Path, default=Path("bench/out/dataplane-profiles"))
    ap.add_argument("--summary", type=Path, help="write the figures as JSON (python -m bench)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pf-bench-dataplane-"))
    redis = start_redis(tmp / "redis")
    modes: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for rnd in range(args.rounds):
            for mode in ("off", "on"):
                w = window(args, mode == "on", tmp, redis.url)
                modes[mode].append(w)
                print(f"round {rnd + 1} background {mode}: Query p99 "
                      f"{percentiles(w['lat']['query'])['p99']:.0f} µs, {w['requests_per_s']:.0f} requests/s, "
                      f"node CPU {w['node_cpu_s'] / w['seconds']:.2f} cores, background {w['background']}", flush=True)
    finally:
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    off, on = summarize(modes["off"]), summarize(modes["on"])
    res: dict = {"off": off, "on": on, "engines": args.engines, "rate_per_engine": args.rate,
                 "save_every": args.save_every, "page_kib": args.page_kib, "seconds": args.seconds,
                 "rounds": args.rounds, "parts": args.parts, "cpus": os.cpu_count(),
                 "load_average_1m": os.getloadavg()[0]}
    for p in ("p50", "p99", "p999"):
        for mode, s in (("off", off), ("on", on)):
            res[f"query_{p}_us_background_{mode}"] = s["calls"]["query"][p]
    res["query_p99_on_over_off"] = res["query_p99_us_background_on"] / res["query_p99_us_background_off"]
    res["query_p999_on_over_off"] = res["query_p999_us_background_on"] / res["query_p999_us_background_off"]
    print(f"\n# Data-path calls with the node's background work off and on ({os.cpu_count()} cores, "
          f"{args.engines} engines x {args.rate:g} requests/s, Reserve+Commit every {args.save_every}; "
          f"{args.rounds} x {args.seconds:g} s per mode)")
    print("| call | off p50 | off p99 | off p999 | on p50 | on p99 | on p999 | on/off p99 | on/off p999 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in CALLS:
        a, b = off["calls"][k], on["calls"][k]
        print(f"| {k} (n={a['n']}/{b['n']}) | {a['p50']:.0f} | {a['p99']:.0f} | {a['p999']:.0f} | {b['p50']:.0f} | "
              f"{b['p99']:.0f} | {b['p999']:.0f} | {b['p99'] / max(a['p99'], 1e-9):.2f}x | "
              f"{b['p999'] / max(a['p999'], 1e-9):.2f}x |")
    print("inside the node, handler p99 (histogram bucket bound, worst window), off / on: " + ", ".join(
        f"{k} {off['node_p99_us'][k]:.0f} / {on['node_p99_us'][k]:.0f} µs" for k in CALLS))
    print(f"node CPU per call: off {off['node_cpu_us_per_call']:.0f} µs, on {on['node_cpu_us_per_call']:.0f} µs")
    print(f"node event-loop lag (a timer every 100 ms; mean, worst window's p99 bucket bound), off / on: "
          f"{off['loop_lag_mean_us']:.0f}, {off['loop_lag_p99_us']:.0f} / {on['loop_lag_mean_us']:.0f}, "
          f"{on['loop_lag_p99_us']:.0f} µs")
    print(f"background in the 'on' windows: {on['background']}")
    print("node garbage collections (generation: count, ms), off / on: " + ", ".join(
        f"{g}: {off['gc'][g]['collections']:.0f}, {off['gc'][g]['seconds'] * 1e3:.1f} / "
        f"{on['gc'][g]['collections']:.0f}, {on['gc'][g]['seconds'] * 1e3:.1f}" for g in "012"))
    print(f"late requests (open loop behind): off {off['late_requests']}, on {on['late_requests']}")
    if args.summary:
        args.summary.write_text(json.dumps(res))
    missing = quiet(on, args.parts)
    if missing:
        errors = [e for w in modes["on"] for e in w["background_errors"]]
        raise SystemExit(f"dataplane: the background did nothing in the 'on' windows: {', '.join(missing)}"
                         + (f" (errors: {'; '.join(errors[:3])})" if errors else ""))
    if off["background"]["l1_evicted_blocks"] or off["background"]["ssd_written_bytes"]:
        raise SystemExit(f"dataplane: the 'off' windows had background work: {off['background']}")
    if on["query_misses"] or off["query_misses"]:
        raise SystemExit("dataplane: the queried prefix was evicted (Query missed); a larger --pool-mb")


if __name__ == "__main__":
    main()
