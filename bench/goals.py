"""Every benchmark goal, in one place, and how ``python -m bench`` runs each benchmark short.

A :class:`Run` is one benchmark script with the arguments of its short mode; it writes its
figures as JSON to the file given by ``--summary`` (ttft: ``--out``). A :class:`Goal` reads
one figure of one run (a dotted path into that JSON), the same-run peer or physical limit
it is compared with (a limit is the best this machine does, e.g. its best copy, never a peer
the product already beats), and the bound it must meet: on the ratio to the peer, or on the
value itself where the goal is absolute (latencies, start-up time). docs/benchmarks.md keeps
the current figures of each script.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    name: str
    script: str  # under bench/
    args: tuple[str, ...]  # the short mode
    summary_flag: str = "--summary"
    root: bool = False  # needs root (network namespaces)
    default: bool = True  # in ``python -m bench``'s default set (False: long; run with --only)


@dataclass(frozen=True)
class Goal:
    run: str
    metric: str  # what the table calls it
    value: str  # dotted path into the run's summary
    unit: str
    peer: str | None  # dotted path of the same-run peer / limit (None: absolute goal without one)
    peer_name: str
    bound: float
    on: str = "ratio"  # "ratio": value / peer (or ``ratio`` below) is bounded; "value": the value is
    higher_is_better: bool = True
    ratio: str | None = None  # a ratio the bench computed itself (a median of per-round ratios), shown
    # and bounded instead of value / peer


ROUND_TRIP = "bare socket round trip, 2 CPUs"
ORIGINAL = "the original's metaserver, same run"

RUNS: tuple[Run, ...] = (
    Run("node", "node.py", ("--rounds", "5", "--inflight", "1")),  # the issue's own command
    Run("pool", "pool.py", ("--pool-gb", "4")),
    Run("spill", "spill.py", ("--seconds", "12")),
    Run("dataplane", "dataplane.py", ("--seconds", "12", "--rounds", "2")),
    Run("saturation", "saturation.py", ("--level-seconds", "3", "--half-seconds", "5", "--start-rate", "4")),
    Run("p2p", "p2p.py", ("--rounds", "3", "--latency-rounds", "2"), root=True),
    Run("backup", "backup.py", (), root=True),  # two fresh 3-node clusters: ~2 min
    # 6,000 lookups of each kind: the idle p99 ratio of 2,000 moved 0.83x-1.14x between runs (bench/meta.py)
    Run("meta", "meta.py", ("--standalone-only", "--queries", "6000")),
    Run("ssd", "ssd.py", ("--size", "1gb", "--repeat", "2", "--engines", "uring")),
    Run("replay", "replay.py", ("--repeat", "5")),
    Run("policy", "policy.py", ("--blocks", "300000", "--repeat", "2")),
    Run("quota", "quota.py", ("--steps", "400")),  # hit rates, not timings: a busy machine is fine
    Run("routing", "routing.py", ()),  # replay hit rates over four traces: seconds, any machine
    Run("ttft", "ttft.py", ("--connectors", "pega,example", "--prompts", "4", "--repeats", "6"), summary_flag="--out"),
    # Five vLLM servers / four engines each: minutes, so only when asked for.
    Run("concurrency", "concurrency.py", ("--rounds", "2"), default=False),
    Run("multiturn", "multiturn.py", (), default=False),
    Run("engine_start", "engine_start.py", ("--rounds", "1"), default=False),
    Run("router", "router.py", (), default=False),
    Run("gpu", "gpu.py", ("--rounds", "3", "--steps", "5"), default=False),  # needs CUDA
)

GOALS: tuple[Goal, ...] = (
    # Copies between an engine's KV cache and the pool, RPCs included, one request in flight, against
    # the best copy this machine does of the same bytes, warm, in the same run (numpy on one thread or
    # two, the better: bench/common.py's best_copy). Small pages pay a round trip per 16 MiB, not 128.
    Goal("node", "save 256 KiB pages, 1 in flight", "save_256k_x1_gbps", "GB/s", "best_copy_gbps", "best copy", 0.7),
    Goal("node", "load 256 KiB pages, 1 in flight", "load_256k_x1_gbps", "GB/s", "best_copy_gbps", "best copy", 0.7),
    Goal("node", "save 2 MiB pages, 1 in flight", "save_2048k_x1_gbps", "GB/s", "best_copy_gbps", "best copy", 0.8),
    Goal("node", "load 2 MiB pages, 1 in flight", "load_2048k_x1_gbps", "GB/s", "best_copy_gbps", "best copy", 0.8),
    # Start-up: the pool is pre-faulted in the background.
    Goal("pool", "first Query after spawn, 4 GiB pool", "first_query_s", "s", "first_query_small_pool_s",
         "same with a 64 MiB pool", 1.0, on="value", higher_is_better=False),
    Goal("pool", "background pre-fault", "prefault_gbps", "GB/s", "memset_fresh_gbps", "memset of fresh memory",
         0.9),
    # Query latency over the local socket while the SSD tier spills and the pool evicts.
    Goal("spill", "Query p99 while spilling + evicting", "loaded_query_p99_us", "µs", "idle_query_p99_us",
         "same node idle", 2000, on="value", higher_is_better=False),
    # The data path with all the node's background work (SSD write-behind, L1 eviction, event
    # publishing to Redis, /metrics scrapers, Stats, the ceiling) on against all of it off, the
    # engines' calls the same (bench/dataplane.py).
    Goal("dataplane", "Query p99, background on / off", "query_p99_us_background_on", "µs",
         "query_p99_us_background_off", "background off, same run", 1.25, higher_is_better=False),
    Goal("dataplane", "Query p999, background on / off", "query_p999_us_background_on", "µs",
         "query_p999_us_background_off", "background off, same run", 2.0, higher_is_better=False),
    # A full host's engines: 8 clients with the connector's calls and copies (each on the client's
    # SCHED_IDLE copy thread, a GPU engine's DMA), at 50% of the rate that saturates the node
    # (bench/saturation.py); the slowest call's p99. Shown beside it, not
    # bounded: the p99 of a bare Unix-socket round trip between two CPUs, the host's floor for any
    # local call whose two ends run on different CPUs.
    Goal("saturation", "slowest call's p99 at 50% of saturation, 8 engines, 256 KiB pages",
         "256k.half_p99_us_max", "µs", "host_round_trip.two_cpus.p99_us", ROUND_TRIP, 1000, on="value",
         higher_is_better=False),
    Goal("saturation", "slowest call's p99 at 50% of saturation, 8 engines, 2 MiB pages",
         "2048k.half_p99_us_max", "µs", "host_round_trip.two_cpus.p99_us", ROUND_TRIP, 1000, on="value",
         higher_is_better=False),
    # Remote reads.
    Goal("p2p", "peer pull, median of rounds (ratio: median of per-round ratios)", "pull_gbps_median", "GB/s",
         "iperf3_gbps_median", "iperf3, same link", 0.85, ratio="ratio_median"),
    # The decode backup (bench/backup.py): 3 nodes, one idle, busy working sets of twice a pool, backup on
    # against off in the same run. The gain is held to the idle pool's useful share of the overflow, the hit rate
    # with the backup on to replay's cluster model run on the same accesses (the module docstring).
    Goal("backup", "hit rate gain, backup on - off (ratio: over the idle pool's share)", "gain_pp", "pp",
         "predicted_gain_pp", "idle pool's share of the overflow", 1.0, ratio="gain_over_predicted"),
    Goal("backup", "hit rate with backup on, |measured - predicted|", "hit_rate_error_pp", "pp", None, "", 2.0,
         on="value", higher_is_better=False),
    Goal("backup", "backup bandwidth, |measured / --backup-max-bandwidth - 1|", "bandwidth_error_pct", "%", None, "",
         10.0, on="value", higher_is_better=False),
    Goal("backup", "busy nodes' Query p99, backup on / off", "query_p99_us_on", "µs", "query_p99_us_off",
         "backup off, same run", 1.25, higher_is_better=False),
    # The metaserver.
    Goal("meta", "updates applied per replica", "apply_blocks_per_s", "/s", "raw_xreadgroup_ack_per_s",
         "redis-py XREADGROUP+XACK msgs/s", 150_000, on="value"),
    Goal("meta", "QueryPrefix 128 blocks via gRPC, p99", "grpc_query_p99_us", "µs", "grpc_floor_p99_us",
         "in-memory gRPC call, interleaved", 2000, on="value", higher_is_better=False),
    Goal("meta", "QueryPrefix p99 while ingesting at full rate", "loaded_grpc_query_p99_us", "µs",
         "loaded_grpc_floor_p99_us", "in-memory gRPC call, interleaved", 5000, on="value", higher_is_better=False),
    # Issue #55: beside the Rust original's metaserver (pegaflow-llm 0.25.1, bench/original_meta.py), the
    # same nodes, events and lookups in the same run, every answer checked. Where the original cannot
    # run (no package index) its figures are absent and these rows do not hold.
    Goal("meta", "RouteHint p99 / the original's QueryPrefixBlocks p99", "grpc_route_p99_us", "µs",
         "original.query_p99_us", ORIGINAL, 1.0, higher_is_better=False),
    Goal("meta", "QueryPrefix p99 / the original's QueryPrefixBlocks p99", "grpc_query_p99_us", "µs",
         "original.query_p99_us", ORIGINAL, 1.0, higher_is_better=False),
    Goal("meta", "ingest, (block, node) pairs/s until answerable / the original's", "ingest_pairs_per_s", "/s",
         "original.ingest_pairs_per_s", ORIGINAL, 1.0),
    Goal("meta", "memory per indexed block (Redis + processes) / the original's (RSS)", "memory_bytes_per_block",
         "B", "original.bytes_per_block", ORIGINAL, 0.5, higher_is_better=False),
    Goal("meta", "RouteHint p99 while ingesting at full rate / the original's doing the same",
         "loaded_grpc_route_p99_us", "µs", "original.loaded_query_p99_us", ORIGINAL, 1.0, higher_is_better=False),
    Goal("meta", "QueryPrefix p99 while ingesting at full rate / the original's doing the same",
         "loaded_grpc_query_p99_us", "µs", "original.loaded_query_p99_us", ORIGINAL, 1.0, higher_is_better=False),
    # The SSD tier against fio on the same file system.
    Goal("ssd", "SSD tier write, 2 MiB pages (ratio: median of per-pair ratios)", "uring_write_gbps", "GB/s",
         "uring_fio_write_gbps", "fio", 0.9, ratio="uring_write_ratio"),
    Goal("ssd", "SSD tier read, 2 MiB pages (ratio: median of per-pair ratios)", "uring_read_gbps", "GB/s",
         "uring_fio_read_gbps", "fio", 0.9, ratio="uring_read_ratio"),
    # Offline analysis.
    Goal("replay", "replay, slowest case", "slowest_accesses_per_s", "accesses/s", "target_accesses_per_s",
         "1M/s target", 1_000_000, on="value"),
    Goal("policy", "HLL distinct-count error, worst size", "hll_u_error_max_abs", "", None, "", 0.01, on="value",
         higher_is_better=False),
    # Namespace quotas: one namespace scans at 8x the other's request rate; the other's hit rate with a
    # quota covering its working set, against its hit rate alone in the same pool (a real node, and replay).
    # The last row keeps the case honest: without the quota the scan must cost the hot namespace much.
    Goal("quota", "hot namespace hit rate gap, alone vs with quota, real node", "node.quota_gap_pp", "pp", None, "",
         1.0, on="value", higher_is_better=False),
    Goal("quota", "hot namespace hit rate gap, alone vs with quota, replay", "replay.quota_gap_pp", "pp", None, "",
         1.0, on="value", higher_is_better=False),
    Goal("quota", "hot namespace hit rate gap, alone vs no quota (the problem), real node", "node.shared_gap_pp",
         "pp", None, "", 20.0, on="value"),
    # Routing over isolated pools (a pool per engine), by replay with its time model, on five traces (Mooncake's
    # public synthetic and conversation traces; conversation-, agent- and scan-shaped ones from bench/traces.py)
    # at two sizes. "conversation traces": the generated one and Mooncake's.
    Goal("routing", "block hit rate, kv-aware / round-robin, isolated pools, worst trace and size",
         "kv_hit_rate_at_kv_over_rr_min", "", "rr_hit_rate_at_kv_over_rr_min", "round-robin, same pools", 1.0,
         ratio="kv_over_rr_min"),
    Goal("routing", "conversation traces: kv-aware / round-robin, isolated pools, worst trace and size",
         "conversation_kv_over_rr_min", "x", None, "", 2.0, on="value"),
    Goal("routing", "conversation traces: kv-aware isolated / one shared pool of the same total, worst trace and size",
         "conversation_kv_over_shared_min", "x", None, "", 0.8, on="value"),
    Goal("routing", "kv-aware imbalance (max/mean requests per instance per minute), worst", "kv_imbalance_max",
         "x", None, "", 1.25, on="value", higher_is_better=False),
    # Time to first token through a real vLLM engine.
    Goal("ttft", "cold / warm TTFT (PegaFlow)", "connectors.pega.cold_mean_ms", "ms",
         "connectors.pega.warm_mean_ms", "PegaFlow warm", 10.0),
    Goal("ttft", "warm TTFT, ExampleConnector / PegaFlow (ratio: median of per-pair ratios)",
         "connectors.pega.warm_mean_ms", "ms", "connectors.example.warm_mean_ms", "ExampleConnector warm", 1.0,
         ratio="connectors.example.warm_vs_pega_median"),
    # Under load (8 x 8K-token prompts), a restarted engine against vLLM's in-engine prefix hit.
    Goal("concurrency", "warm TTFT at 4 rps, PegaFlow / in-engine prefix hit", "warm_rate.pega.mean_ms", "ms",
         "warm_rate.prefix.mean_ms", "vLLM prefix cache", 1.1, higher_is_better=False),
    Goal("concurrency", "warm TTFT 8 concurrent, PegaFlow / in-engine prefix hit", "warm_concurrent.pega.mean_ms",
         "ms", "warm_concurrent.prefix.mean_ms", "vLLM prefix cache", 1.1, higher_is_better=False),
    Goal("concurrency", "warm TTFT at 4 rps, ExampleConnector / PegaFlow", "warm_rate.pega.mean_ms", "ms",
         "warm_rate.example.mean_ms", "ExampleConnector warm", 1.0, ratio="warm_rate.example_over_pega"),
    Goal("concurrency", "warm TTFT 8 concurrent, ExampleConnector / PegaFlow", "warm_concurrent.pega.mean_ms", "ms",
         "warm_concurrent.example.mean_ms", "ExampleConnector warm", 1.0, ratio="warm_concurrent.example_over_pega"),
    # vLLM's start with the connector, next to a 16 GiB node: the pool is the node's, not the engine's.
    Goal("engine_start", "vLLM ready, PegaFlow / no connector, 16 GiB node (ratio: median of per-round ratios)",
         "largest.pega_ready_s", "s", "largest.none_ready_s", "no connector, same node", 1.05,
         higher_is_better=False, ratio="largest.pega_over_none"),
    Goal("engine_start", "connector registration, 16 GiB node", "largest.register_ms", "ms", None, "", 1000,
         on="value", higher_is_better=False),
    # Conversations through two engines taking turns: replay predicts what the engines hit.
    Goal("multiturn", "token hit rate, |measured - replay| (decode saves)", "decode_saves.hit_rate_error_pp", "pp",
         None, "", 1.0, on="value", higher_is_better=False),
    Goal("multiturn", "token hit rate, |measured - replay| (prompt blocks only)", "prompt_only.hit_rate_error_pp",
         "pp", None, "", 1.0, on="value", higher_is_better=False),
    # A trace slice through pegaflow router and four engines: where requests go decides what hits.
    Goal("router", "block hit rate, kv-aware + shared / round-robin + isolated", "kv_shared_block_hit_rate", "",
         "rr_isolated_block_hit_rate", "round-robin + isolated, same capacity", 3.0,
         ratio="kv_shared_over_rr_isolated"),
    Goal("router", "block hit rate, |measured - replay|, worst run", "max_gap_pp", "pp", None, "", 2.0, on="value",
         higher_is_better=False),
    # The CUDA data path (a GPU host): DMAs against pinned cudaMemcpy, and what copies cost a step.
    Goal("gpu", "save GB/s, 64 blocks (GPU -> pool)", "save_gbps", "GB/s", "pinned_d2h_gbps",
         "pinned cudaMemcpy D2H", 0.8),
    Goal("gpu", "load GB/s, 64 blocks (pool -> GPU)", "load_gbps", "GB/s", "pinned_h2d_gbps",
         "pinned cudaMemcpy H2D", 0.8),
    Goal("gpu", "10K-token step, + load and save beside it", "step_with_copies_ms", "ms", "step_ms",
         "the step alone", 1.05, higher_is_better=False),
    # Registering the pool with CUDA (a background thread, never inside a copy), apart.
    Goal("gpu", "pool registration with CUDA", "pin_gib_per_s", "GiB/s", None, "", 2.0, on="value"),
)
