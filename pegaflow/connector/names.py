"""The other connector names the original's vLLM plugin (0.25.1) registers, and what each is here.

``NoopKVConnector`` is served as in the original: a connector that loads and saves nothing,
the baseline that measures what vLLM's connector path costs by itself. The original's
prefill/decode connectors (``PdConnector``, ``PdDecodeConnector``, ``PdPrefillConnector``:
RDMA push between engines) and its NIXL connectors (``NixlConnector``, ``NixlPullConnector``,
``NixlPushConnector``, ``PegaNixlConnector``, ``PegaNixlPullConnector``: vLLM's NIXL connector,
forked) have no counterpart here: prefill/decode runs through the node pool, behind ``pegaflow
router``. A config that names one of them is refused when vLLM creates the connector, with one
line saying what to use instead (``plugin.refusal``), so an engine never starts with a silent
substitute. The names resolve (vLLM's factory checks the class before it creates one); only
creating one raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from pegaflow.connector.intents import PegaConnectorMetadata
from pegaflow.connector.plugin import REFUSED, refusal
from pegaflow.connector.settings import prefers_cross_layer_blocks
from pegaflow.connector.vllm_compat import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class RefusedConnector(KVConnectorBase_V1, SupportsHMA):
    """A name of the original that is refused here: creating one raises ``ValueError``
    (``refusal``). It subclasses vLLM's connector base and ``SupportsHMA`` so that vLLM's
    checks of the class before it creates one (its constructor's arguments, hybrid KV cache
    support) pass and the refusal is the error the engine stops with."""

    def __new__(cls, *args: object, **kwargs: object) -> RefusedConnector:
        raise ValueError(refusal(cls.__name__))


def _refused(name: str) -> type[RefusedConnector]:
    return cast("type[RefusedConnector]",
                type(name, (RefusedConnector,), {"__doc__": refusal(name), "__module__": __name__}))


REFUSED_CLASSES: dict[str, type[RefusedConnector]] = {name: _refused(name) for name in REFUSED}


class NoopKVConnector(KVConnectorBase_V1, SupportsHMA):
    """The original's baseline connector: vLLM runs its connector path (every hook is
    called), and nothing is loaded or saved. As there, it asks vLLM 0.20-0.28 for one
    cross-layer KV cache tensor unless the model is MLA, has several KV cache groups, or
    ``PEGAFLOW_CROSS_LAYER_BLOCKS`` is off."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # vLLM's base types kv_cache_config as always given; one made without it keeps None
        # (read for its groups only): the cast is the checker's only.
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=cast("KVCacheConfig", kv_cache_config))
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        hf = getattr(vllm_config.model_config, "hf_text_config", None)
        self._mla = getattr(hf, "kv_lora_rank", None) is not None  # the original's test
        self._groups = len(groups)

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return prefers_cross_layer_blocks() and not self._mla and self._groups <= 1

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PegaConnectorMetadata:
        return PegaConnectorMetadata(step=0)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None
