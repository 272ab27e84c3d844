"""Typed configuration: one frozen dataclass per command, filled from the option table.

:mod:`pegaflow.config.options` is the only definition of each option (flag, environment
variable, default, parser, help). The classes here only name the parsed values and their
types, so code downstream of the command line reads ``config.pool_size`` (checked, and
immutable) instead of an ``argparse.Namespace``. ``tests/unit/test_options.py`` fails when
a class and the table disagree (a field without an option, or an option without a field).

    config = load(NODE, "pegaflow-node", argv)       # flags > PEGAFLOW_* > defaults
    config = node_config(pool_size=1 << 30)          # defaults plus overrides (tests, tools)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

from pegaflow.config.capacity import Capacity
from pegaflow.config.options import (
    CACHE,
    META,
    NODE,
    REPLAY,
    ROUTER,
    STATUS,
    SUBCOMMAND,
    SUBCOMMANDS,
    build_parser,
    fill_defaults,
    options_for,
)
from pegaflow.policy.quota import Quota


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """``pegaflow-node`` (the NODE rows of the option table)."""

    addr: str
    pool_size: int
    use_hugepages: bool
    devices: tuple[int, ...]
    hint_value_size: int
    disable_numa_affinity: bool
    pool_shards: int
    blockwise_alloc: bool
    http_addr: str
    log_level: str
    log_format: str
    reservation_ttl: float
    lease_ttl: float
    max_batch: int
    max_namespaces: int
    max_pinned_share: float
    local_socket: str
    query_trace: str
    trace_sample_rate: float
    page_align: int
    ssd_cache_path: tuple[str, ...]
    ssd_cache_capacity: int
    ssd_queue_depth: int
    ssd_write_queue_size: int
    ssd_io_engine: str
    ssd_cache_shards: int
    ssd_write_queue_depth: int
    ssd_prefetch_queue_depth: int
    ssd_write_inflight: int
    ssd_prefetch_inflight: int
    max_prefetch_blocks: int
    redis_url: tuple[str, ...]  # the seeds, tried in order (empty: none)
    redis_cluster: bool
    node_id: str
    advertise_addr: str
    metaserver_addr: str
    transfer_addr: str
    nics: tuple[str, ...]
    qps_per_peer: int
    pin_ttl: float
    peer_backoff: float
    liveness_ttl: float
    event_buffer: int
    metaserver_queue_depth: int
    # The original's decode backup (0.25): pegaflow/node/backup.py.
    backup_reclaimable_percent: int
    backup_max_candidates: int
    backup_pull_max_bytes: int
    backup_max_bandwidth: int  # bytes per second; 0: unlimited
    auth_token_file: str
    tls_cert: str
    tls_key: str
    tls_ca: str
    no_auth: bool
    access_group: str
    enable_lfu_admission: bool
    namespace_quota: tuple[Quota, ...]
    ceiling_windows: tuple[float, ...]
    metric_hll_bucket_bits: int
    ceiling_publish_interval: float
    metrics_otel_endpoint: str
    metrics_period_secs: int
    enable_prometheus: bool
    metrics_render_interval: float

    @property
    def joins_cluster(self) -> bool:
        """Publishes to a global index (``--redis-url``) or asks a metaserver for one."""
        return bool(self.redis_url or self.metaserver_addr)


@dataclass(frozen=True, slots=True)
class MetaConfig:
    """``pegaflow-meta`` (the META rows)."""

    http_addr: str
    log_level: str
    log_format: str
    addr: str
    redis_url: tuple[str, ...]  # the seeds, tried in order (empty: none)
    redis_cluster: bool
    consumer_name: str
    stream_lease_ttl: float
    sweep_interval: float
    index_census_interval: float
    node_stale_secs: int
    ttl_minutes: float  # minutes without node activity before the sweeper removes the node
    min_reclaimable_owner_count: int
    enable_decode_backup: bool
    backup_target_delay_secs: int
    query_max_blocks: int
    view_max_lag_ms: int
    auth_token_file: str
    tls_cert: str
    tls_key: str
    ceiling_windows: tuple[float, ...]
    metric_hll_bucket_bits: int
    metrics_otel_endpoint: str
    metrics_period_secs: int

    def check(self) -> None:
        """The combination one flag cannot check (ValueError, one line), as the original's."""
        if self.ttl_minutes * 60 < self.node_stale_secs:
            raise ValueError(f"--ttl-minutes ({self.ttl_minutes}) must cover --node-stale-secs "
                             f"({self.node_stale_secs})")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """``pegaflow replay TRACE`` (the REPLAY rows)."""

    log_level: str
    log_format: str
    backup_reclaimable_percent: int
    min_reclaimable_owner_count: int
    enable_decode_backup: bool
    enable_lfu_admission: bool
    namespace_quota: tuple[Quota, ...]
    ceiling_windows: tuple[float, ...]
    trace: str
    trace_format: str
    namespace_field: str
    l1_capacity: Capacity
    ssd_capacity: Capacity
    ssd_writes: str
    page_bytes: int
    block_tokens: int
    instances: int
    nodes: int
    idle_nodes: int
    pools: str
    route: str
    compare_admission: bool
    sweep: tuple[Capacity, ...]
    json: bool
    plot: str
    skip_bad: bool
    quiet: bool
    jobs: int
    prefill_us_per_token: float
    decode_seconds: float
    commit_at_prefill_end: bool
    load_bound: float
    load_window: float
    ssd_hit_cost: float


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """``pegaflow router`` (the ROUTER rows)."""

    log_level: str
    log_format: str
    host: str
    port: int
    engine: tuple[str, ...]
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    policy: str
    metaserver_addr: str
    tokenizer: str
    skip_tokenizer_init: bool
    load_bound: float
    load_window: float
    ssd_hit_cost: float
    peer_hit_cost: float
    hint_timeout: float
    health_interval: float
    backoff_max: float
    request_timeout: float
    engine_api_key: str

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)

    def check(self) -> None:
        """The combinations one flag cannot check (ValueError, one line)."""
        if self.disaggregated and self.engine:
            raise ValueError("give --engine, or --prefill and --decode, not both")
        if self.disaggregated and not (self.prefill and self.decode):
            raise ValueError("prefill/decode disaggregation needs at least one --prefill and one --decode")
        if not (self.engine or self.disaggregated):
            raise ValueError("no engines: give --engine URL ..., or --prefill URL ... --decode URL ...")
        urls = [*self.engine, *self.prefill, *self.decode]
        if len(set(urls)) < len(urls):
            raise ValueError("an engine URL is given twice")


@dataclass(frozen=True, slots=True)
class StatusConfig:
    """``pegaflow status`` (the STATUS rows)."""

    auth_token_file: str
    tls_ca: str
    addr: str
    metaserver: str
    watch: float
    json: bool
    timeout: float


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """``pegaflow cache SUBCOMMAND`` (the CACHE rows). The options of the subcommands not
    chosen hold their defaults; ``--namespace`` is one field for the two rows that define it."""

    subcommand: str  # inspect, clear, pin, unpin or pins
    auth_token_file: str
    tls_ca: str
    addr: str
    timeout: float
    json: bool
    namespace: str
    tokens: str
    tokens_file: str
    hashes: tuple[str, ...]
    block_size: int
    lora_name: str
    lora_path: str
    cache_salt: str
    metaserver: str
    instance: str
    all: bool
    name: str
    id: str


CONFIGS: dict[str, type] = {NODE: NodeConfig, META: MetaConfig, REPLAY: ReplayConfig, ROUTER: RouterConfig,
                            STATUS: StatusConfig, CACHE: CacheConfig}
C = TypeVar("C", NodeConfig, MetaConfig, ReplayConfig, RouterConfig, StatusConfig, CacheConfig)


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def from_namespace(cls: type[C], ns: argparse.Namespace) -> C:
    """The typed config of parsed options (lists become tuples: a config is immutable)."""
    return cls(**{f.name: _frozen(getattr(ns, f.name)) for f in dataclasses.fields(cls)})


# One overload per command: its config class.
@overload
def load(
    command: Literal["node"], prog: str, argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None, description: str = "",
) -> NodeConfig: ...
@overload
def load(
    command: Literal["meta"], prog: str, argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None, description: str = "",
) -> MetaConfig: ...
@overload
def load(
    command: Literal["replay"], prog: str, argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None, description: str = "",
) -> ReplayConfig: ...
@overload
def load(
    command: Literal["router"], prog: str, argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None, description: str = "",
) -> RouterConfig: ...
@overload
def load(
    command: Literal["status"], prog: str, argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None, description: str = "",
) -> StatusConfig: ...
@overload
def load(
    command: Literal["cache"], prog: str, argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None, description: str = "",
) -> CacheConfig: ...
def load(
    command: str, prog: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
    description: str = "",
) -> NodeConfig | MetaConfig | ReplayConfig | RouterConfig | StatusConfig | CacheConfig:
    """Parse ``argv`` (flags > ``PEGAFLOW_*`` > defaults) into the command's config class.

    A bad flag or variable is one line on stderr and exit status 2 (never a traceback)."""
    p = build_parser(command, prog, description)
    return from_namespace(CONFIGS[command], fill_defaults(p.parse_args(argv), command, prog, env))


def node_config(**overrides: Any) -> NodeConfig:
    """The node's defaults (no flags, no environment) with ``overrides`` applied."""
    cfg = load(NODE, NODE, [], env={})
    return dataclasses.replace(cfg, **{k: _frozen(v) for k, v in overrides.items()})


def field_names(command: str) -> list[str]:
    """The option table's destinations for ``command``, in table order, each once (the test's
    side); a command with subcommands first names the one chosen."""
    names = [o.dest for o in options_for(command)]
    return ([SUBCOMMAND] if command in SUBCOMMANDS else []) + list(dict.fromkeys(names))
