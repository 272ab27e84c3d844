"""Prometheus metrics of the SSD tier (``pegaflow_node_ssd_*``), in the node's registry, and
the tier's numbers that the Stats RPC reports (:class:`SsdStats`), read from the same objects."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pegaflow.node.metrics import SSD_IO_THROUGHPUT_BUCKETS, value_of, values_by_label

PROMOTE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class SsdStats:
    """The SSD tier in the Stats RPC (``node_pb2.SsdStats``, field for field)."""

    capacity_bytes: int
    used_bytes: int
    blocks: int
    write_bytes: int  # totals since start
    read_bytes: int
    write_bytes_per_second: float  # over the last second
    read_bytes_per_second: float
    write_queue_blocks: int
    promoted_blocks: int
    skipped_writes: dict[str, int]  # blocks never written, by reason (queue_full, too_large, io_error)


class SsdMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.capacity = Gauge("pegaflow_node_ssd_capacity_bytes", "Usable bytes of the SSD tier (all files).",
                              registry=r)
        self.used = Gauge("pegaflow_node_ssd_used_bytes", "Bytes of indexed records on SSD (headers included).",
                          registry=r)
        self.blocks = Gauge("pegaflow_node_ssd_blocks", "Blocks indexed on SSD.", registry=r)
        self.write_bytes = Counter("pegaflow_node_ssd_write_bytes_total", "Page bytes written to SSD.", registry=r)
        self.read_bytes = Counter("pegaflow_node_ssd_read_bytes_total", "Page bytes read from SSD.", registry=r)
        self.write_throughput = Gauge("pegaflow_node_ssd_write_bytes_per_second",
                                      "SSD write throughput over the last second.", registry=r)
        self.read_throughput = Gauge("pegaflow_node_ssd_read_bytes_per_second",
                                     "SSD read throughput over the last second.", registry=r)
        self.write_io_throughput = Histogram(
            "pegaflow_node_ssd_write_io_throughput_bytes_per_second",
            "Throughput of each SSD write I/O (one writev of adjacent records): its bytes over the time from "
            "its issue to its completion.", buckets=SSD_IO_THROUGHPUT_BUCKETS, registry=r)
        self.read_io_throughput = Histogram(
            "pegaflow_node_ssd_read_io_throughput_bytes_per_second",
            "Throughput of each SSD read I/O (one readv of adjacent records, for a promotion or a peer's "
            "transfer): its bytes over the time from its issue to its completion.",
            buckets=SSD_IO_THROUGHPUT_BUCKETS, registry=r)
        self.queue_blocks = Gauge("pegaflow_node_ssd_write_queue_blocks",
                                  "Blocks pinned in L1 waiting for their SSD write.", registry=r)
        self.queue_bytes = Gauge("pegaflow_node_ssd_write_queue_bytes",
                                 "Bytes pinned in L1 waiting for their SSD write.", registry=r)
        self.inflight = Gauge("pegaflow_node_ssd_inflight_ios", "SSD I/Os submitted and not completed.",
                              registry=r)
        d = ["direction"]  # write | prefetch: the per-direction bounds of gate.py
        self.dir_inflight = Gauge("pegaflow_node_ssd_direction_inflight_ios",
                                  "SSD I/Os of one direction submitted and not completed "
                                  "(at most --ssd-write-inflight / --ssd-prefetch-inflight).", d, registry=r)
        self.dir_peak = Gauge("pegaflow_node_ssd_direction_inflight_ios_peak",
                              "Most SSD I/Os of one direction in flight at once since start.", d, registry=r)
        self.dir_waiting = Gauge("pegaflow_node_ssd_direction_waiting_batches",
                                 "Batches of one direction waiting for an in-flight slot "
                                 "(at most --ssd-write-queue-depth / --ssd-prefetch-queue-depth).", d, registry=r)
        self.prefetch_dropped = Counter("pegaflow_node_ssd_prefetch_dropped_blocks_total",
                                        "Blocks on SSD not promoted because --ssd-prefetch-queue-depth "
                                        "batches were already waiting.", registry=r)
        self.prefetch_deferred = Counter("pegaflow_node_ssd_prefetch_deferred_blocks_total",
                                         "Blocks on SSD not promoted by a Query because --max-prefetch-blocks "
                                         "reads were in flight (left for the engine's next Query).", registry=r)
        self.skipped = Counter("pegaflow_node_ssd_skipped_writes_total",
                               "Blocks not written to SSD, by reason (queue_full, too_large, io_error).",
                               ["reason"], registry=r)
        self.written = Counter("pegaflow_node_ssd_written_blocks_total", "Blocks written to SSD.", registry=r)
        self.evicted = Counter("pegaflow_node_ssd_evicted_blocks_total",
                               "Blocks dropped from SSD when their segment was reclaimed.", registry=r)
        self.checksum_failures = Counter("pegaflow_node_ssd_checksum_failures_total",
                                         "SSD reads whose header or checksum did not match (served as a miss).",
                                         registry=r)
        self.read_errors = Counter("pegaflow_node_ssd_read_errors_total", "SSD reads that failed with an I/O error.",
                                   registry=r)
        self.promoted = Counter("pegaflow_node_ssd_promoted_blocks_total", "Blocks promoted from SSD into L1.",
                                registry=r)
        self.promote_latency = Histogram("pegaflow_node_ssd_promotion_seconds",
                                         "Time from the Query that found blocks on SSD until they are in L1.",
                                         buckets=PROMOTE_BUCKETS, registry=r)

    def stats(self) -> SsdStats:
        """The values these metrics export now (the gauges' sources are read, as a scrape does)."""
        return SsdStats(
            capacity_bytes=int(value_of(self.capacity)), used_bytes=int(value_of(self.used)),
            blocks=int(value_of(self.blocks)), write_bytes=int(value_of(self.write_bytes)),
            read_bytes=int(value_of(self.read_bytes)), write_bytes_per_second=value_of(self.write_throughput),
            read_bytes_per_second=value_of(self.read_throughput), write_queue_blocks=int(value_of(self.queue_blocks)),
            promoted_blocks=int(value_of(self.promoted)),
            skipped_writes={k: int(v) for k, v in values_by_label(self.skipped).items()},
        )


class IoClock:
    """Times one I/O for the throughput histograms: :meth:`issued` from the op's ``prepare``
    (on the engine thread, just before the I/O is issued), :meth:`done` from its
    ``complete`` with the bytes it moved (the whole op or nothing: a short or failed I/O is
    not observed)."""

    __slots__ = ("histogram", "t0")

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.t0 = 0.0

    def issued(self) -> None:
        self.t0 = time.perf_counter()

    def done(self, nbytes: int) -> None:
        elapsed = time.perf_counter() - self.t0
        if self.t0 and elapsed > 0:
            self.histogram.observe(nbytes / elapsed)
