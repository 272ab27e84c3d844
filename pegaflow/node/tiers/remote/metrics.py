"""Prometheus metrics of remote reads (``pegaflow_node_p2p_*``), in the node's registry, and
the numbers of them that the Stats RPC reports (:class:`PeerStats`), read from the same objects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pegaflow.core.tiers import LOCAL_TIERS
from pegaflow.node.metrics import value_of, values_by_label

PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
PULL_STATUSES = ("ok", "partial", "checksum", "bad_answer", "error", "gone", "no_space")


@dataclass(frozen=True, slots=True)
class PeerStats:
    """Remote reads in the Stats RPC (``node_pb2.PeerStats``, field for field): pulls and serving."""

    pulls: dict[str, int]  # by status (PULL_STATUSES)
    pull_bytes: int
    served_bytes: int
    active_pins: int
    backed_off_peers: int
    lookups: dict[str, int]  # metaserver lookups by result (found, none, error)


class PeerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.pulls = Counter(
            "pegaflow_node_p2p_pulls_total",
            "Pulls of a prefix from a peer, by status (ok, partial, checksum, bad_answer, error, gone, no_space).",
            ["status"], registry=r,
        )  # fmt: skip
        for s in PULL_STATUSES:
            self.pulls.labels(s)
        self.pull_bytes = Counter("pegaflow_node_p2p_pull_bytes_total",
                                  "Page bytes pulled from peers, verified and committed into L1.", registry=r)
        self.pull_latency = Histogram("pegaflow_node_p2p_pull_seconds",
                                      "Time from the Query that started a pull until its pages are committed.",
                                      buckets=PULL_BUCKETS, registry=r)
        self.served_bytes = Counter("pegaflow_node_p2p_served_bytes_total",
                                    "Page bytes this node sent to pullers on its TCP data port.", registry=r)
        self.active_pins = Gauge("pegaflow_node_p2p_active_pins", "Pins this node holds for pullers.", registry=r)
        self.pins_expired = Counter("pegaflow_node_p2p_pins_expired_total",
                                    "Pins that reached their TTL without Unpin (puller died or was slow).",
                                    registry=r)
        self.pin_checksum_seconds = Histogram("pegaflow_node_p2p_pin_checksum_seconds",
                                              "Time to get the checksums of one RDMA pin (hashing only pages not known yet).", buckets=PULL_BUCKETS,
                                              registry=r)
        self.hashed_bytes = Counter(
            "pegaflow_node_p2p_hashed_bytes_total",
            "Page bytes this node hashed for remote reads, by when: commit (in the background, before any "
            "pull) or transfer (a page sent or pinned before its checksum was known).",
            ["when"], registry=r,
        )  # fmt: skip
        for s in ("commit", "transfer"):
            self.hashed_bytes.labels(s)
        self.hash_skipped_bytes = Counter(
            "pegaflow_node_p2p_hash_skipped_bytes_total",
            "Committed page bytes not hashed in the background because its queue was full (hashed when sent).",
            registry=r)
        self.known_checksums = Gauge("pegaflow_node_p2p_known_checksums",
                                     "Resident blocks whose page checksum is known (no re-read when served).",
                                     registry=r)
        self.rdma_qps = Gauge("pegaflow_node_p2p_rdma_queue_pairs",
                              "RDMA RC queue pairs open, by role: pull (ours, --qps-per-peer per NIC pair "
                              "and peer) and serve (answering pullers' RdmaConnect); 0 on a TCP node.",
                              ["role"], registry=r)
        for role in ("pull", "serve"):
            self.rdma_qps.labels(role)
        self.backed_off = Gauge("pegaflow_node_p2p_backed_off_peers",
                                "Peers skipped for now after a failed or wrong answer.", registry=r)
        self.ssd_served = Counter(
            "pegaflow_node_p2p_ssd_served_blocks_total",
            "Blocks this node read from its SSD tier straight into a puller's pin (not promoted).", registry=r)
        self.pulled_blocks = Counter(
            "pegaflow_node_p2p_pulled_blocks_total",
            "Blocks pulled from peers and committed, by the tier the holder was listed in (l1, ssd).",
            ["holder_tier"], registry=r)
        for tier in LOCAL_TIERS:
            self.pulled_blocks.labels(tier)
        self.held_blocks = Gauge(
            "pegaflow_node_p2p_held_blocks",
            "Pages pulled from peers (and the local prefix before them) pinned for the engine's next Query "
            "to lease; each is released when a Query leases it, or after the hold time.", registry=r)
        self.hold_ended = Counter(
            "pegaflow_node_p2p_hold_ended_blocks_total",
            "Pages whose pull hold ended, by why: leased (a Query leased them) or expired (none did in time).",
            ["reason"], registry=r)
        for s in ("leased", "expired"):
            self.hold_ended.labels(s)
        self.lookups = Counter("pegaflow_node_p2p_lookups_total",
                               "Metaserver lookups after a local miss, by result (found, none, error).",
                               ["result"], registry=r)
        for s in ("found", "none", "error"):
            self.lookups.labels(s)

    def bind_rdma(self, pull: Callable[[], float] | None, serve: Callable[[], float] | None) -> None:
        """Read the open queue pairs at scrape time (``None``: that side has no RDMA, 0)."""
        for role, fn in (("pull", pull), ("serve", serve)):
            if fn is not None:
                self.rdma_qps.labels(role).set_function(fn)

    def stats(self) -> PeerStats:
        """The values these metrics export now (the gauges' sources are read, as a scrape does)."""
        return PeerStats(
            pulls={k: int(v) for k, v in values_by_label(self.pulls).items()},
            pull_bytes=int(value_of(self.pull_bytes)), served_bytes=int(value_of(self.served_bytes)),
            active_pins=int(value_of(self.active_pins)), backed_off_peers=int(value_of(self.backed_off)),
            lookups={k: int(v) for k, v in values_by_label(self.lookups).items()},
        )
