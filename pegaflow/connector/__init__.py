"""vLLM connector for PegaFlow.

``kv_connector_module_path: "pegaflow.connector"`` makes vLLM load ``PegaKVConnector``
from here. The vLLM-facing class is imported lazily so that the parts that need no vLLM
(page layout in ``layout``, ``settings``, the node ``link``, ``inflight``) import without
it; block identity is ``pegaflow.core.identity``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegaflow.connector.connector import PegaKVConnector

__all__ = ["PegaKVConnector"]


def __getattr__(name: str) -> type[PegaKVConnector]:
    if name == "PegaKVConnector":
        from pegaflow.connector.connector import PegaKVConnector

        return PegaKVConnector
    raise AttributeError(name)
