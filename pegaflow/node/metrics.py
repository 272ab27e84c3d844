"""Prometheus metrics of the node. Names: ``pegaflow_node_<what>[_<unit>][_total]``.

Gauges that mirror state (pool usage, resident blocks, leases) are computed at scrape
time from the live objects, so they can never drift from the truth. The Rust original's
names (``pegaflow_pool_used_bytes``, ``pegaflow_rpc_duration_seconds``, ...) are derived from
these at scrape time: :func:`original_aliases`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pegaflow.common.heap import GcPauses
from pegaflow.common.loop_lag import lag_histogram
from pegaflow.common.metric_alias import Alias, OriginalNames, Relabel, ValueAlias, rpc_labels
from pegaflow.core.tiers import MISS, OUTCOMES, Tier

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# The original's buckets (pegaflow-core/src/metrics.rs), which its names keep: save and load
# durations from 10 ms (its GPU transfers of a whole batch), SSD throughput in 1 GB/s steps.
ORIGINAL_COPY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0)
ORIGINAL_SSD_THROUGHPUT_BUCKETS = tuple(i * 1e9 for i in range(1, 41))
# Ours add finer bounds below theirs (the aliases drop them): one rank's copies of one step
# on a CPU host are memcpys of a few MiB (~1 ms), and one SSD I/O of 64 KiB pages seldom
# reaches 1 GB/s.
COPY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, *ORIGINAL_COPY_BUCKETS)
SSD_IO_THROUGHPUT_BUCKETS = (1e8, 2.5e8, 5e8, *ORIGINAL_SSD_THROUGHPUT_BUCKETS)


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.rpc_latency = Histogram(
            "pegaflow_node_rpc_duration_seconds",
            "Latency of node RPCs by method, gRPC status and transport (grpc, local).",
            ["method", "status", "transport"],
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.hits = Counter("pegaflow_node_hit_blocks_total", "Blocks found by Query, by tier.", ["tier"], registry=r)
        # Timed once the daemon runs (GcPauses.install): a collection pauses the event loop too.
        self.gc_pauses = GcPauses("pegaflow_node_gc_pause_seconds",
                                  "Garbage collections of the node process by generation (0, 1, 2) and their "
                                  "length: every thread's Python, the data path's loop included, waits meanwhile.")
        r.register(self.gc_pauses)
        # Sampled once the daemon runs (pegaflow/common/loop_lag.py): whatever holds the loop
        # or the GIL (a background thread's Python, a collection) delays every call it serves.
        self.loop_lag = lag_histogram("pegaflow_node_event_loop_lag_seconds", "the node", r)
        self.misses = Counter("pegaflow_node_miss_blocks_total", "Blocks asked by Query and not found.", registry=r)
        self.queries = Counter("pegaflow_node_queries_total", "Query RPCs by outcome.", ["outcome"], registry=r)
        self.evictions = Counter("pegaflow_node_evictions_total",
                                 "Blocks evicted from L1 to make room (not those a reset or an operator removed).",
                                 ["tier"], registry=r)
        self.removed = Counter("pegaflow_node_removed_blocks_total",
                               "Blocks removed from L1 because they were told to go, by reason: reset (an "
                               "engine's Reset), clear (pegaflow cache clear), cleanup (POST /cache/memory/cleanup).",
                               ["reason"], registry=r)
        for reason in ("reset", "clear", "cleanup"):
            self.removed.labels(reason)
        self.save_bytes = Counter("pegaflow_node_save_bytes_total", "Bytes committed into L1 by engines.", registry=r)
        self.load_bytes = Counter("pegaflow_node_load_bytes_total", "Bytes leased to engines for loading.", registry=r)
        # The engines' copies (they run in the engine: pegaflow/connector/worker.py), as the
        # engines report them on their Commits and Releases (node.proto, CopyTimes).
        self.save_copy = Histogram("pegaflow_node_save_copy_seconds",
                                   "Engines' save copies (KV cache -> pool pages), one per rank and engine step, "
                                   "as the engines report them.", buckets=COPY_BUCKETS, registry=r)
        self.load_copy = Histogram("pegaflow_node_load_copy_seconds",
                                   "Engines' load copies (pool pages -> KV cache), one per rank and engine step, "
                                   "as the engines report them.", buckets=COPY_BUCKETS, registry=r)
        self.load_copy_failures = Counter("pegaflow_node_load_copy_failures_total",
                                          "Engines' load batches that failed (vLLM recomputed their blocks), as the "
                                          "engines report them.", registry=r)
        self.reserve_skipped = Counter(
            "pegaflow_node_reserve_skipped_blocks_total",
            "Blocks not given a page by Reserve, by reason.",
            ["reason"],
            registry=r,
        )
        self.namespaces_dropped = Counter(
            "pegaflow_node_namespaces_dropped_total",
            "Namespaces forgotten because they held no block (L1 or SSD) and no live session used them.",
            registry=r,
        )
        self.expired = Counter(
            "pegaflow_node_expired_total",
            "Reservations and leases held past their TTL by a live engine (reported, never taken from "
            "it), and sessions ended because they never opened their Session stream.",
            ["kind"], registry=r
        )
        self.sessions_closed = Counter("pegaflow_node_sessions_closed_total", "Sessions ended.", registry=r)
        self.resets = Counter("pegaflow_node_resets_total",
                              "Reset calls: an engine dropped its namespaces' blocks (reset_prefix_cache).",
                              registry=r)
        self.pool_capacity = Gauge("pegaflow_node_pool_capacity_bytes", "Size of the L1 pool.", registry=r)
        self.pool_prefaulted = Gauge("pegaflow_node_pool_prefaulted_bytes",
                                     "Bytes of the pool pre-faulted so far (only these are handed out; "
                                     "equal to the capacity once the background pre-fault is done).", registry=r)
        self.pool_largest_free = Gauge(
            "pegaflow_node_pool_largest_free_bytes",
            "Largest free extent of the pool: the biggest page that can be allocated without evicting "
            "(fragmentation when much smaller than capacity - used). Sampled every second.",
            registry=r,
        )
        self.pool_used = Gauge("pegaflow_node_pool_used_bytes", "Bytes of the pool in use (resident + pending).", registry=r)
        self.resident_blocks = Gauge("pegaflow_node_resident_blocks", "Committed blocks in L1.", registry=r)
        self.resident_bytes = Gauge("pegaflow_node_resident_bytes", "Bytes of committed blocks in L1.", registry=r)
        self.leases = Gauge("pegaflow_node_active_leases", "Leases currently held.", registry=r)
        self.reservations = Gauge("pegaflow_node_active_reservations", "Uncommitted reservations.", registry=r)
        self.sessions = Gauge("pegaflow_node_sessions", "Registered engine sessions.", registry=r)
        self.pinned_bytes = Gauge("pegaflow_node_pinned_bytes",
                                  "Bytes the operators' pins ask for (pegaflow cache pin).", registry=r)
        self.pins = Gauge("pegaflow_node_pins", "Operators' pins (pegaflow cache pins).", registry=r)
        # Hit-rate ceiling per window (pegaflow/node/accounting.py), refreshed by the node's loop.
        self.ceiling = Gauge(
            "pegaflow_node_ceiling_hit_ratio",
            "Hit-rate ceiling r* = (N - U) / N of the requests in the window.",
            ["window"],
            registry=r,
        )
        self.hit_ratio = Gauge(
            "pegaflow_node_measured_hit_ratio", "Measured hit rate (hits / N) in the window.", ["window"], registry=r
        )
        self.window_requested = Gauge(
            "pegaflow_node_window_requested_blocks", "N: blocks requested in the window.", ["window"], registry=r
        )
        self.window_hits = Gauge(
            "pegaflow_node_window_hit_blocks", "Blocks served from cache in the window.", ["window"], registry=r
        )
        self.window_distinct = Gauge(
            "pegaflow_node_window_distinct_blocks",
            "U: distinct blocks requested in the window (HyperLogLog estimate).",
            ["window"],
            registry=r,
        )
        self.request_blocks = Counter(
            "pegaflow_node_request_blocks_total",
            "Blocks of each request by where they were found (l1, ssd, remote, miss); once per request.",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.request_blocks.labels(outcome)
        self.sketch_publications = Counter(
            "pegaflow_node_ceiling_sketch_publications_total",
            "Ceiling sketches written to Redis for the cluster view, by result (ok, error).",
            ["result"],
            registry=r,
        )
        # Counters kept by the index as plain ints, read at scrape time (bind()).
        self._fn_counters: dict[str, Callable[[], float]] = {}
        for key, name, doc in (
            ("admission_rejections", "pegaflow_node_admission_rejections",
             "New blocks not stored because TinyLFU preferred the LRU victim."),
            ("evicted_bytes", "pegaflow_node_evicted_bytes",
             "Bytes of the blocks evicted from L1 to make room (their pages are freed at once)."),
            ("removed_held", "pegaflow_node_removed_held_blocks",
             "Blocks removed from L1 (an engine's Reset, pegaflow cache clear) while a lease, a pin, an SSD "
             "write or a peer's transfer held them: their page is freed when the last holder lets go."),
        ):
            self._fn_counters[key] = lambda: 0
            r.register(_FnCounter(name, doc, self._fn_counter(key)))
        for tier in Tier:  # export zeros, so dashboards see every tier
            self.hits.labels(tier)
        self.evictions.labels(Tier.L1)
        for kind in ("reservation", "lease", "session"):  # 0 until one expires, so a panel has series
            self.expired.labels(kind)
        self.inserted = Counter(
            "pegaflow_node_inserted_blocks_total",
            "Blocks that became resident in L1 (committed by engines, promoted from SSD, pulled from peers).",
            registry=r,
        )
        # Evictions by replacement class: pulled copies (reclaimable, evicted first) or retained.
        self._by_class: Callable[[], tuple[int, int]] = lambda: (0, 0)  # (evictions, of them reclaimable)

        def by_class() -> dict[tuple[str, ...], float]:
            total, reclaimable = self._by_class()
            return {("reclaimable",): reclaimable, ("retained",): total - reclaimable}

        r.register(_FnCounter(
            "pegaflow_node_evicted_blocks_by_class",
            "Blocks evicted from L1 by replacement class: reclaimable (copies pulled from peers, "
            "first in line) or retained (the rest).", by_class, ("class",),
        ))  # fmt: skip
        self._load_pins: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0)
        r.register(_LoadPins(lambda: self._load_pins()))
        OriginalNames(r, original_aliases(self))

    def observe_copies(self, save_seconds: Sequence[float], load_seconds: Sequence[float], load_failures: int) -> None:
        """An engine's report of its copies (checked by the caller: finite, not negative)."""
        for v in save_seconds:
            self.save_copy.observe(v)
        for v in load_seconds:
            self.load_copy.observe(v)
        if load_failures:
            self.load_copy_failures.inc(load_failures)

    def _fn_counter(self, key: str) -> Callable[[], float]:
        """Reads ``_fn_counters[key]`` at scrape time (the function bound last)."""
        return lambda: self._fn_counters[key]()

    def bind(
        self,
        *,
        evictions_by_class: Callable[[], tuple[int, int]] | None = None,  # (evictions, of them reclaimable)
        load_pins: Callable[[], tuple[int, int, int, int]] | None = None,  # Sessions.load_pins
        **sources: Callable[[], float],
    ) -> None:
        """Compute state gauges (and the index's counters: ``admission_rejections``,
        ``evicted_bytes``, ``removed_held``) at scrape time: ``bind(pool_used=lambda: ...)``."""
        if evictions_by_class is not None:
            self._by_class = evictions_by_class
        if load_pins is not None:
            self._load_pins = load_pins
        for name, fn in sources.items():
            if name in self._fn_counters:
                self._fn_counters[name] = fn
            else:
                getattr(self, name).set_function(fn)


class _FnCounter(Collector):
    """A counter whose value is read from a live object at scrape time (a monotonic int);
    with ``labels``, ``fn`` gives ``{label values: value}``."""

    def __init__(self, name: str, doc: str, fn: Callable[[], float | Mapping[tuple[str, ...], float]],
                 labels: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.fn, self.labels = name, doc, fn, labels

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.doc, labels=self.labels)]

    def collect(self) -> list[CounterMetricFamily]:
        value = self.fn()
        if not isinstance(value, Mapping):  # unlabelled
            return [CounterMetricFamily(self.name, self.doc, value=float(value))]
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, v in value.items():
            fam.add_metric(list(key), float(v))
        return [fam]


LOAD_PINS = (
    ("pegaflow_node_lease_pin_entries", "Distinct (session, block) pairs the leases pin."),
    ("pegaflow_node_lease_pin_refs", "Block references held by leases (a block in two leases counts twice)."),
    ("pegaflow_node_lease_pinned_blocks", "Distinct blocks pinned by leases."),
    ("pegaflow_node_lease_pinned_bytes", "Bytes of the distinct blocks pinned by leases."),
)


class _LoadPins(Collector):
    """The leases' pins (Sessions.load_pins), four gauges from one pass at scrape time."""

    def __init__(self, fn: Callable[[], tuple[int, int, int, int]]) -> None:
        self.fn = fn

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(n, d) for n, d in LOAD_PINS]

    def collect(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(n, d, value=float(v)) for (n, d), v in zip(LOAD_PINS, self.fn(), strict=True)]


def value_of(metric: Counter | Gauge) -> float:
    """An unlabelled counter's or gauge's value now, read through its public ``collect()``
    (a gauge's ``set_function`` is called): the tiers' typed ``stats()``, which the Stats RPC
    reports, read their metrics objects with it, so they report what ``/metrics`` renders."""
    for sample in next(iter(metric.collect())).samples:
        if not sample.name.endswith("_created"):
            return sample.value
    raise ValueError(f"{metric!r} has no sample (a labelled metric: values_by_label)")


def values_by_label(metric: Counter | Gauge) -> dict[str, float]:
    """A one-label counter's or gauge's values now: ``{label value: value}`` of its children."""
    return {next(iter(sample.labels.values())): sample.value for sample in next(iter(metric.collect())).samples
            if not sample.name.endswith("_created")}


def _only(**want: str) -> Relabel:
    """Keep the samples whose labels match ``want``; the original's series has no label."""
    def relabel(labels: Mapping[str, str]) -> dict[str, str] | None:
        return {} if all(labels.get(k) == v for k, v in want.items()) else None
    return relabel


def _one_of(label: str, values: tuple[str, ...]) -> Relabel:
    def relabel(labels: Mapping[str, str]) -> dict[str, str] | None:
        return {} if labels.get(label) in values else None
    return relabel


def _same(labels: Mapping[str, str]) -> dict[str, str]:
    return dict(labels)


def _reason(labels: Mapping[str, str]) -> dict[str, str]:
    return {"reason": labels["reason"]}


# The original's label values for our outcomes (its pegaflow_cache_tier_block_requests{tier}:
# ram, rdma, ssd, miss): a contract of its dashboards, so spelled as it spells them.
_ORIGINAL_TIER: dict[str, str] = {Tier.L1: "ram", Tier.REMOTE: "rdma", Tier.SSD: "ssd", MISS: "miss"}


def original_aliases(m: NodeMetrics) -> list[Alias | ValueAlias]:
    """The Rust original's node metrics (its docs/metrics.md, pegaflow-core/src/metrics.rs,
    pegaflow-server/src/metric.rs) that mean something here, each read from our series.
    docs/metrics.md, "The original's names", has the table, and those left out and why."""
    window = ("window",)
    return [
        # Pool
        Alias("pegaflow_pool_used_bytes", "gauge", "Pool bytes in use (pegaflow_node_pool_used_bytes).",
              ("pegaflow_node_pool_used_bytes",)),
        Alias("pegaflow_pool_capacity_bytes", "gauge", "Pool size (pegaflow_node_pool_capacity_bytes).",
              ("pegaflow_node_pool_capacity_bytes",)),
        Alias("pegaflow_pool_largest_free_bytes", "gauge",
              "Largest free extent of the pool (pegaflow_node_pool_largest_free_bytes).",
              ("pegaflow_node_pool_largest_free_bytes",)),
        Alias("pegaflow_pool_alloc_failures", "counter",
              "Blocks Reserve gave no page because every page was pinned or admission refused "
              "(pegaflow_node_reserve_skipped_blocks_total{reason=\"no_space\"}).",
              ("pegaflow_node_reserve_skipped_blocks",), relabel=_only(reason="no_space")),
        ValueAlias("pegaflow_inflight_bytes", "gauge",
                   "Bytes of pages reserved and not yet committed (pool used - resident).",
                   lambda: [((), max(0.0, value_of(m.pool_used) - value_of(m.resident_bytes)))]),
        # Cache
        Alias("pegaflow_cache_block_hits", "counter",
              "Blocks found in L1 by Query answers (pegaflow_node_hit_blocks_total{tier=\"l1\"}).",
              ("pegaflow_node_hit_blocks",), relabel=_only(tier=Tier.L1)),
        Alias("pegaflow_cache_block_misses", "counter",
              "Blocks of READY Query answers past the hit prefix (pegaflow_node_miss_blocks_total).",
              ("pegaflow_node_miss_blocks",)),
        Alias("pegaflow_cache_tier_block_requests", "counter",
              "Blocks of each request by the tier that served them: ram (l1), rdma (remote: a peer node), ssd, miss "
              "(pegaflow_node_request_blocks_total{outcome}).",
              ("pegaflow_node_request_blocks",), ("tier",),
              relabel=lambda lb: ({"tier": _ORIGINAL_TIER[lb["outcome"]]} if lb.get("outcome") in _ORIGINAL_TIER
                                  else None),
              fixed=tuple((v,) for v in _ORIGINAL_TIER.values())),
        Alias("pegaflow_cache_block_insertions", "counter",
              "Blocks that became resident in L1 (pegaflow_node_inserted_blocks_total).",
              ("pegaflow_node_inserted_blocks",)),
        Alias("pegaflow_cache_block_admission_rejections", "counter",
              "Admission (TinyLFU) refusals (pegaflow_node_admission_rejections_total).",
              ("pegaflow_node_admission_rejections",)),
        Alias("pegaflow_cache_block_evictions", "counter",
              "Blocks evicted from L1 (pegaflow_node_evictions_total{tier=\"l1\"}).",
              ("pegaflow_node_evictions",), relabel=_only(tier=Tier.L1)),
        Alias("pegaflow_cache_block_evictions_by_class", "counter",
              "Blocks evicted from L1 by replacement class: reclaimable (pulled copies) or retained "
              "(pegaflow_node_evicted_blocks_by_class_total{class}).",
              ("pegaflow_node_evicted_blocks_by_class",), ("class",), relabel=_same,
              fixed=(("reclaimable",), ("retained",))),
        Alias("pegaflow_cache_block_evictions_still_referenced", "counter",
              "Blocks removed from L1 while still held, their page freed at the last release "
              "(pegaflow_node_removed_held_blocks_total: a Reset or a clear of a leased or pinned block).",
              ("pegaflow_node_removed_held_blocks",)),
        Alias("pegaflow_cache_eviction_reclaimed_bytes", "counter",
              "Bytes of the blocks evicted from L1; eviction frees the page at once "
              "(pegaflow_node_evicted_bytes_total).",
              ("pegaflow_node_evicted_bytes",)),
        Alias("pegaflow_cache_residence_duration_seconds", "histogram",
              "Time blocks stayed in L1, first insertion to removal, by reason (pressure, cleanup) "
              "(pegaflow_node_block_residence_seconds).",
              ("pegaflow_node_block_residence_seconds",), ("reason",), relabel=_reason),
        Alias("pegaflow_cache_resident_blocks", "gauge", "Committed blocks in L1 (pegaflow_node_resident_blocks).",
              ("pegaflow_node_resident_blocks",)),
        Alias("pegaflow_cache_resident_bytes", "gauge", "Bytes of committed blocks in L1 (pegaflow_node_resident_bytes).",
              ("pegaflow_node_resident_bytes",)),
        # Load-path pins: the original pins blocks for an engine's load; leases do that here.
        Alias("pegaflow_pinned_for_load_entries", "gauge",
              "Distinct (session, block) pairs pinned by leases (pegaflow_node_lease_pin_entries).",
              ("pegaflow_node_lease_pin_entries",)),
        Alias("pegaflow_pinned_for_load_refs", "gauge",
              "Block references held by leases (pegaflow_node_lease_pin_refs).",
              ("pegaflow_node_lease_pin_refs",)),
        Alias("pegaflow_pinned_for_load_unique_blocks", "gauge",
              "Distinct blocks pinned by leases (pegaflow_node_lease_pinned_blocks).",
              ("pegaflow_node_lease_pinned_blocks",)),
        Alias("pegaflow_pinned_for_load_unique_bytes", "gauge",
              "Bytes of the distinct blocks pinned by leases (pegaflow_node_lease_pinned_bytes).",
              ("pegaflow_node_lease_pinned_bytes",)),
        # HyperLogLog reuse (the hit-rate ceiling, pegaflow/node/accounting.py)
        Alias("pegaflow_hll_cardinality", "gauge",
              "Distinct blocks requested in the window, HyperLogLog (pegaflow_node_window_distinct_blocks).",
              ("pegaflow_node_window_distinct_blocks",), window, relabel=_same),
        Alias("pegaflow_hll_total_requests", "gauge",
              "Blocks requested in the window (pegaflow_node_window_requested_blocks).",
              ("pegaflow_node_window_requested_blocks",), window, relabel=_same),
        Alias("pegaflow_hll_estimated_hit_rate", "gauge",
              "Infinite-cache hit rate 1 - distinct/requested in the window (pegaflow_node_ceiling_hit_ratio).",
              ("pegaflow_node_ceiling_hit_ratio",), window, relabel=_same),
        # Engine <-> pool
        Alias("pegaflow_save_bytes", "counter", "Bytes committed into L1 by engines (pegaflow_node_save_bytes_total).",
              ("pegaflow_node_save_bytes",)),
        Alias("pegaflow_load_bytes", "counter", "Bytes leased to engines for loading (pegaflow_node_load_bytes_total).",
              ("pegaflow_node_load_bytes",)),
        # The engines' copies, as they report them
        Alias("pegaflow_save_duration_seconds", "histogram",
              "Engines' save copies, one per rank and step (pegaflow_node_save_copy_seconds).",
              ("pegaflow_node_save_copy_seconds",), buckets=frozenset(ORIGINAL_COPY_BUCKETS)),
        Alias("pegaflow_load_duration_seconds", "histogram",
              "Engines' load copies, one per rank and step (pegaflow_node_load_copy_seconds).",
              ("pegaflow_node_load_copy_seconds",), buckets=frozenset(ORIGINAL_COPY_BUCKETS)),
        Alias("pegaflow_load_failures", "counter",
              "Engines' load batches that failed (pegaflow_node_load_copy_failures_total).",
              ("pegaflow_node_load_copy_failures",)),
        # SSD
        *_ssd_throughput_aliases(),
        Alias("pegaflow_ssd_write_bytes", "counter", "Page bytes written to SSD (pegaflow_node_ssd_write_bytes_total).",
              ("pegaflow_node_ssd_write_bytes",)),
        Alias("pegaflow_ssd_write_failures", "counter",
              "SSD writes that failed (pegaflow_node_ssd_skipped_writes_total{reason=\"io_error\"}).",
              ("pegaflow_node_ssd_skipped_writes",), relabel=_only(reason="io_error")),
        Alias("pegaflow_ssd_write_queue_pending", "gauge",
              "Blocks waiting for their SSD write (pegaflow_node_ssd_write_queue_blocks).",
              ("pegaflow_node_ssd_write_queue_blocks",)),
        Alias("pegaflow_ssd_write_queue_full", "counter",
              "Blocks not written to SSD because the write queue was full "
              "(pegaflow_node_ssd_skipped_writes_total{reason=\"queue_full\"}).",
              ("pegaflow_node_ssd_skipped_writes",), relabel=_only(reason="queue_full")),
        Alias("pegaflow_ssd_write_inflight", "gauge",
              "SSD write I/Os in flight, at most --ssd-write-inflight "
              "(pegaflow_node_ssd_direction_inflight_ios{direction=\"write\"}).",
              ("pegaflow_node_ssd_direction_inflight_ios",), relabel=_only(direction="write")),
        Alias("pegaflow_ssd_prefetch_bytes", "counter", "Page bytes read from SSD (pegaflow_node_ssd_read_bytes_total).",
              ("pegaflow_node_ssd_read_bytes",)),
        Alias("pegaflow_ssd_prefetch_success", "counter",
              "Blocks promoted from SSD into L1 (pegaflow_node_ssd_promoted_blocks_total).",
              ("pegaflow_node_ssd_promoted_blocks",)),
        Alias("pegaflow_ssd_prefetch_failures", "counter",
              "SSD reads that failed: I/O error or checksum mismatch "
              "(pegaflow_node_ssd_read_errors_total + pegaflow_node_ssd_checksum_failures_total).",
              ("pegaflow_node_ssd_read_errors", "pegaflow_node_ssd_checksum_failures")),
        Alias("pegaflow_ssd_prefetch_inflight", "gauge",
              "SSD read I/Os in flight, at most --ssd-prefetch-inflight "
              "(pegaflow_node_ssd_direction_inflight_ios{direction=\"prefetch\"}).",
              ("pegaflow_node_ssd_direction_inflight_ios",), relabel=_only(direction="prefetch")),
        Alias("pegaflow_ssd_prefetch_queue_full", "counter",
              "Blocks on SSD not promoted because --ssd-prefetch-queue-depth batches were waiting "
              "(pegaflow_node_ssd_prefetch_dropped_blocks_total).",
              ("pegaflow_node_ssd_prefetch_dropped_blocks",)),
        Alias("pegaflow_ssd_prefetch_backpressure_blocks", "counter",
              "Blocks on SSD past --max-prefetch-blocks, left for the engine's next Query "
              "(pegaflow_node_ssd_prefetch_deferred_blocks_total).",
              ("pegaflow_node_ssd_prefetch_deferred_blocks",)),
        Alias("pegaflow_ssd_prefetch_duration_seconds", "histogram",
              "From the Query that found blocks on SSD until they are in L1 (pegaflow_node_ssd_promotion_seconds).",
              ("pegaflow_node_ssd_promotion_seconds",)),
        # Global index publication (the original registers blocks with its metaserver)
        Alias("pegaflow_metaserver_registration_blocks", "counter",
              "Block updates published for the global index: inserts and snapshots "
              "(pegaflow_node_events_published_blocks_total{op=~\"insert|snapshot\"}).",
              ("pegaflow_node_events_published_blocks",), relabel=_one_of("op", ("insert", "snapshot"))),
        Alias("pegaflow_metaserver_removal_blocks", "counter",
              "Block removals published for the global index "
              "(pegaflow_node_events_published_blocks_total{op=\"evict\"}).",
              ("pegaflow_node_events_published_blocks",), relabel=_only(op="evict")),
        Alias("pegaflow_metaserver_registration_queue_full", "counter",
              "Block updates dropped: buffer full or Redis unreachable (pegaflow_node_events_dropped_blocks_total).",
              ("pegaflow_node_events_dropped_blocks",)),
        Alias("pegaflow_metaserver_registration_failures", "counter",
              "Redis errors of the event publisher (pegaflow_node_events_publish_errors_total).",
              ("pegaflow_node_events_publish_errors",)),
        # Serving peers (the original's RDMA transfer lock) and pulling from them
        Alias("pegaflow_transfer_lock_active", "gauge", "Pins held for pullers (pegaflow_node_p2p_active_pins).",
              ("pegaflow_node_p2p_active_pins",)),
        # Each of these two twice: the original's instruments are named ..._total, which its
        # exporter serves as ..._total_total (its docs/deployment.md queries
        # pegaflow_rdma_fetch_total_total); ..._total is the name its docs/metrics.md gives.
        *(Alias(name, "counter", "Pins that reached their TTL without Unpin (pegaflow_node_p2p_pins_expired_total).",
                ("pegaflow_node_p2p_pins_expired",))
          for name in ("pegaflow_transfer_lock_timeouts", "pegaflow_transfer_lock_timeouts_total")),
        *(Alias(name, "counter", "Pulls from peers: ok (ok, partial) or error (pegaflow_node_p2p_pulls_total{status}).",
                ("pegaflow_node_p2p_pulls",), ("status",), relabel=_pull_status)
          for name in ("pegaflow_rdma_fetch", "pegaflow_rdma_fetch_total")),
        Alias("pegaflow_rdma_fetch_duration_seconds", "histogram",
              "From the Query that started a pull until its pages are committed (pegaflow_node_p2p_pull_seconds).",
              ("pegaflow_node_p2p_pull_seconds",)),
        Alias("pegaflow_rdma_qps", "gauge",
              "RDMA RC queue pairs open, pulling and serving (pegaflow_node_p2p_rdma_queue_pairs, summed); "
              "0 on a TCP node.",
              ("pegaflow_node_p2p_rdma_queue_pairs",)),
        Alias("pegaflow_rdma_fetch_bytes", "counter",
              "Page bytes pulled from peers (pegaflow_node_p2p_pull_bytes_total).",
              ("pegaflow_node_p2p_pull_bytes",)),
        # RPCs (both transports)
        Alias("pegaflow_rpc_requests", "counter",
              "Node RPCs by method and status (the count of pegaflow_node_rpc_duration_seconds).",
              ("pegaflow_node_rpc_duration_seconds",), ("method", "status"), relabel=rpc_labels, from_count=True),
        Alias("pegaflow_rpc_duration_seconds", "histogram",
              "Node RPC latency by method and status (pegaflow_node_rpc_duration_seconds, transports summed).",
              ("pegaflow_node_rpc_duration_seconds",), ("method", "status"), relabel=rpc_labels),
    ]


def _pull_status(labels: Mapping[str, str]) -> dict[str, str]:
    """Our pull outcomes as the original's ``status``: ok (ok, partial) or error."""
    return {"status": "ok" if labels.get("status") in ("ok", "partial") else "error"}


def _ssd_throughput_aliases() -> list[Alias | ValueAlias]:
    """The original's per-I/O SSD throughput histograms (unit ``bytes/s``), each under two
    names: ``..._throughput_per_second``, as its exporter names its instrument
    ``pegaflow_ssd_write_throughput`` (an unknown unit before ``/s`` adds only ``_per_second``),
    and ``..._throughput_bytes_per_second_per_second``, which its Grafana dashboard queries
    (the name of an earlier instrument, ``..._throughput_bytes_per_second``, plus that suffix)."""
    out: list[Alias | ValueAlias] = []
    for direction, ours in (("write", "pegaflow_node_ssd_write_io_throughput_bytes_per_second"),
                            ("prefetch", "pegaflow_node_ssd_read_io_throughput_bytes_per_second")):
        for name in (f"pegaflow_ssd_{direction}_throughput_per_second",
                     f"pegaflow_ssd_{direction}_throughput_bytes_per_second_per_second"):
            out.append(Alias(name, "histogram", f"SSD {direction} throughput of each I/O, bytes/s ({ours}).",
                             (ours,), buckets=frozenset(ORIGINAL_SSD_THROUGHPUT_BUCKETS)))
    return out


# ---- Replacement classes (docs/architecture.md, "Replacement classes") -----------------------------
# Why a block left the retained class, as the original labels it: reclaim_hint (the metaserver
# counted enough holders), backup_hint (a decode node backed it up). The original's third,
# transfer_release (its source demoted a block a peer copied), has no case here: the puller's
# copy is reclaimable from its reservation and the source keeps its own retained.
DEMOTION_REASONS = ("reclaim_hint", "backup_hint")
CLASSES = ("reclaimable", "retained")


class ClassMetrics(Collector):
    """``pegaflow_node_resident_bytes_by_class{class}`` and ``pegaflow_node_class_demotions_total{reason}``,
    read at scrape time from ``source()``: (resident bytes, of them reclaimable, blocks demoted by
    reason); registered on ``registry`` with the original's names as aliases."""

    def __init__(self, registry: CollectorRegistry, source: Callable[[], tuple[int, int, Mapping[str, int]]]) -> None:
        self.source = source
        registry.register(self)
        OriginalNames(registry, [
            Alias("pegaflow_cache_resident_bytes_by_class", "gauge",
                  "Bytes of committed blocks in L1 by replacement class "
                  "(pegaflow_node_resident_bytes_by_class{class}).",
                  ("pegaflow_node_resident_bytes_by_class",), ("class",), relabel=_same,
                  fixed=tuple((c,) for c in CLASSES)),
            Alias("pegaflow_cache_class_demotions", "counter",
                  "Blocks moved from retained to reclaimable, by reason "
                  "(pegaflow_node_class_demotions_total{reason}).",
                  ("pegaflow_node_class_demotions",), ("reason",), relabel=_same,
                  fixed=tuple((r,) for r in DEMOTION_REASONS)),
        ])  # fmt: skip

    def describe(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return list(self._families(0, 0, {}))

    def collect(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return list(self._families(*self.source()))

    @staticmethod
    def _families(resident: int, reclaimable: int, demoted: Mapping[str, int]
                  ) -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        g = GaugeMetricFamily("pegaflow_node_resident_bytes_by_class",
                              "Bytes of committed blocks in L1 by replacement class: reclaimable (evicted first: "
                              "pulled copies, blocks enough nodes hold) or retained.", labels=["class"])
        g.add_metric(["reclaimable"], float(reclaimable))
        g.add_metric(["retained"], float(resident - reclaimable))
        c = CounterMetricFamily("pegaflow_node_class_demotions",
                                "Blocks moved from retained to reclaimable in L1, by reason: reclaim_hint (the "
                                "metaserver counted --min-reclaimable-owner-count holders), backup_hint.",
                                labels=["reason"])
        for reason in DEMOTION_REASONS:
            c.add_metric([reason], float(demoted.get(reason, 0)))
        return g, c
