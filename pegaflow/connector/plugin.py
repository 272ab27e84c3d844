"""vLLM general plugin: registers ``PegaKVConnector`` with vLLM's connector factory.

Installed as the ``vllm.general_plugins`` entry point ``pegaflow`` (pyproject.toml), which
vLLM loads in every process it starts (API server, engine core, every worker), as the
original does. With it ``{"kv_connector": "PegaKVConnector"}`` works without
``kv_connector_module_path``, and so does naming it inside ``MultiConnector``'s list. Loading
it imports nothing heavy: the class is imported when vLLM creates the connector. It may
run several times in one process (vLLM says plugins must tolerate that).
"""

from __future__ import annotations

import logging

NAME = "PegaKVConnector"
MODULE = "pegaflow.connector.connector"

logger = logging.getLogger("vllm.pegaflow")


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME in KVConnectorFactory._registry:  # loaded again in this process, or vLLM ships one
        return
    KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    logger.debug("PegaFlow: %s registered with vLLM's connector factory", NAME)
