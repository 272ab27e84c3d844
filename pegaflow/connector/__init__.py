"""vLLM connector for PegaFlow.

``kv_connector_module_path: "pegaflow.connector"`` makes vLLM load ``PegaKVConnector``
from here. The vLLM-facing classes are imported lazily so that the parts that need no vLLM
(page layout in ``layout``, ``settings``, the node ``link``, ``inflight``) import without
it; block identity is ``pegaflow.core.identity``. The other names the original's vLLM plugin
registers resolve here too (``names``): ``NoopKVConnector`` is served, its prefill/decode and
NIXL connectors are refused when vLLM creates one, saying what to use instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegaflow.connector.vllm_compat import KVConnectorBase_V1

__all__ = ["PegaKVConnector", "NoopKVConnector"]


def __getattr__(name: str) -> type[KVConnectorBase_V1]:
    if name == "PegaKVConnector":
        from pegaflow.connector.connector import PegaKVConnector

        return PegaKVConnector
    if name == "NoopKVConnector":
        from pegaflow.connector.names import NoopKVConnector

        return NoopKVConnector
    from pegaflow.connector.plugin import REFUSED_NAMES

    if name in REFUSED_NAMES:
        from pegaflow.connector.names import REFUSED_CLASSES

        return REFUSED_CLASSES[name]
    raise AttributeError(name)
