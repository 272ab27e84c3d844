"""The original's ``kv_connector_module_path: "pegaflow.pd_connector"``: its prefill/decode (RDMA push) connectors.

This PegaFlow has none of them: each name resolves to a connector that vLLM cannot create,
whose error says what to use instead (``pegaflow.connector.names``), so a config pasted from
the original fails at start-up with that line rather than "No module named ...".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegaflow.connector.names import RefusedConnector

NAMES = ("PdConnector", "PdDecodeConnector", "PdPrefillConnector")  # the original module's connectors


def __getattr__(name: str) -> type[RefusedConnector]:
    if name in NAMES:
        from pegaflow.connector.names import REFUSED_CLASSES

        return REFUSED_CLASSES[name]
    raise AttributeError(name)
