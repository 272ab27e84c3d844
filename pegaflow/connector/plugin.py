"""vLLM general plugin: registers PegaFlow's connector names with vLLM's connector factory.

Installed as the ``vllm.general_plugins`` entry point ``pegaflow`` (pyproject.toml), which
vLLM loads in every process it starts (API server, engine core, every worker), as the
original does. With it ``{"kv_connector": "PegaKVConnector"}`` works without
``kv_connector_module_path``, and so does naming it inside ``MultiConnector``'s list. It
registers every name the original's plugin (0.25.1) registers, all from
``pegaflow.connector``: ``PegaKVConnector``, ``NoopKVConnector`` (served), and the original's
prefill/decode and NIXL connectors, which are refused when vLLM creates one, saying what to
use instead (``pegaflow.connector.names``). A name vLLM already has stays vLLM's (its own
``NixlConnector``; ``NixlPullConnector`` and ``NixlPushConnector`` too in vLLM 0.32), as with
the original, whose registration of such a name failed quietly.
Loading it imports nothing heavy: a class is imported when vLLM creates the connector. It may
run several times in one process (vLLM says plugins must tolerate that).
"""

from __future__ import annotations

import logging

MODULE = "pegaflow.connector"  # every name resolves there (its module __getattr__)
SERVED_NAMES = ("PegaKVConnector", "NoopKVConnector")

_PD_INSTEAD = (
    "run the prefill engine and the decode engine with PegaKVConnector "
    '(kv_connector_extra_config {"pegaflow.mode": "save_only"} and {"pegaflow.mode": "load_only"}) '
    "behind `pegaflow router --prefill URL --decode URL`: the decode engine loads the prefill's "
    "blocks through the node pool (docs/router.md)"
)
_NIXL_INSTEAD = (
    f"for prefill/decode, {_PD_INSTEAD}; for vLLM's own NIXL transfer, leave kv_connector_module_path "
    'out and name vLLM\'s connector ("NixlConnector")'
)
# The original's other names: name -> (what it was there, what to use here instead).
REFUSED: dict[str, tuple[str, str]] = {
    "PdConnector": ("prefill/decode connector (RDMA push between engines)", _PD_INSTEAD),
    "PdDecodeConnector": ("prefill/decode connector, decode side", _PD_INSTEAD),
    "PdPrefillConnector": ("prefill/decode connector, prefill side", _PD_INSTEAD),
    "NixlConnector": ("fork of vLLM's NIXL connector (an alias of NixlPullConnector)", _NIXL_INSTEAD),
    "NixlPullConnector": ("fork of vLLM's NIXL connector (RDMA READ)", _NIXL_INSTEAD),
    "NixlPushConnector": ("fork of vLLM's NIXL connector (RDMA WRITE)", _NIXL_INSTEAD),
    "PegaNixlConnector": ("NIXL connector with PegaFlow's transport", _NIXL_INSTEAD),
    "PegaNixlPullConnector": ("NIXL connector with PegaFlow's transport (RDMA READ)", _NIXL_INSTEAD),
}
REFUSED_NAMES = tuple(REFUSED)

logger = logging.getLogger("vllm.pegaflow")


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in SERVED_NAMES + REFUSED_NAMES:
        if name in KVConnectorFactory._registry:  # loaded again in this process, or vLLM's own
            continue
        KVConnectorFactory.register_connector(name, MODULE, name)
    logger.debug("PegaFlow: connector names registered with vLLM's connector factory")


def refusal(name: str) -> str:
    """The one line an engine configured with connector ``name`` fails to start with."""
    was, instead = REFUSED[name]
    return f"{name} is the original PegaFlow's {was}, which this PegaFlow does not have: {instead}"
