"""The connector's settings: every ``kv_connector_extra_config`` key and environment variable.

One table (``SETTINGS``) names each setting once: its ``kv_connector_extra_config`` key, its
environment variable, its default and what it does. ``load_settings`` reads them into a
typed ``ConnectorSettings`` (the connector never looks at the raw dict again) and
``render_markdown`` writes the table of docs/connector.md (a unit test fails when the page
is stale). Precedence, as in the original: environment > ``kv_connector_extra_config`` >
default; ``pegaflow.addr`` overrides host and port (see ``link.node_address``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from pegaflow.connector.link import ExtraConfig, node_address
from pegaflow.core.hosts import NODE_ADDR, NODE_HOST, NODE_PORT

READ_WRITE = "read_write"
SAVE_ONLY = "save_only"  # a prefill engine: computes and saves, never loads
LOAD_ONLY = "load_only"  # a decode engine: loads what prefill saved, never saves
MODES = (READ_WRITE, SAVE_ONLY, LOAD_ONLY)


@dataclass(frozen=True)
class Setting:
    key: str | None  # kv_connector_extra_config key (None: environment only)
    env: str | None  # environment variable (None: extra config only)
    default: str
    meaning: str
    default_is_value: bool = True  # False: ``default`` describes it in words (not code-formatted)


SETTINGS: tuple[Setting, ...] = (
    Setting("pegaflow.host", "PEGAFLOW_HOST", NODE_HOST,
            "Node host; also `http://HOST` or `http://HOST:PORT` (the original's form)."),
    Setting("pegaflow.port", "PEGAFLOW_PORT", str(NODE_PORT), "Node gRPC port."),
    Setting("pegaflow.addr", None, "",
            "`HOST:PORT` of the node; overrides host and port when set."),
    Setting("pegaflow.mode", "PEGAFLOW_MODE", READ_WRITE,
            "`read_write`; `save_only` (a prefill engine: saves, never loads); "
            "`load_only` (a decode engine: loads, never saves)."),
    Setting("pegaflow.save_decode_blocks", "PEGAFLOW_SAVE_DECODE_BLOCKS", "true",
            "Also save the full blocks of generated tokens, so the next turn of a conversation "
            "hits its previous answer; `false` saves prompt blocks only."),
    Setting("pegaflow.async_load", "PEGAFLOW_ASYNC_LOAD", "true",
            "While the node promotes a request's blocks from SSD or pulls them from a peer, tell "
            "vLLM the load is asynchronous (it runs other requests and is told when the copy is "
            "done); `false` keeps the request waiting (re-asked every 5 ms). Engines with several "
            "KV cache groups always load asynchronously."),
    Setting("pegaflow.model_id", None, "the model path",
            "The model's name in the namespace, when the same weights live at different paths "
            "on different hosts.", default_is_value=False),
    Setting(None, "PEGAFLOW_COPY_KERNEL", "measured",
            "Force the page-copy kernel (`memcpy`, `nt-avx2`, `nt-sse2`, a `-2t` suffix for two "
            "threads) instead of measuring the candidates on the first large copies.", default_is_value=False),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class ConnectorSettings:
    addr: str = NODE_ADDR
    mode: str = READ_WRITE
    save_decode_blocks: bool = True
    async_load: bool = True
    model_id: str | None = None

    @property
    def loads(self) -> bool:
        return self.mode != SAVE_ONLY

    @property
    def saves(self) -> bool:
        return self.mode != LOAD_ONLY


def _raw(key: str, env_name: str | None, extra: ExtraConfig, env: Mapping[str, str]) -> object:
    if env_name and env.get(env_name) not in (None, ""):
        return env[env_name]
    return extra.get(key)


def _bool(name: str, value: object, default: bool) -> bool:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean (true/false)")


def load_settings(extra: ExtraConfig | None = None, env: Mapping[str, str] | None = None) -> ConnectorSettings:
    """The connector's settings from ``kv_connector_extra_config`` and the environment.

    Raises ``ValueError`` with a one-line reason for a value it cannot use.
    """
    extra = extra or {}
    env = os.environ if env is None else env
    mode = str(_raw("pegaflow.mode", "PEGAFLOW_MODE", extra, env) or READ_WRITE).strip().lower()
    if mode not in MODES:
        raise ValueError(f"pegaflow.mode={mode!r} is not one of {', '.join(MODES)}")
    save_decode = _bool("pegaflow.save_decode_blocks",
                        _raw("pegaflow.save_decode_blocks", "PEGAFLOW_SAVE_DECODE_BLOCKS", extra, env), True)
    async_load = _bool("pegaflow.async_load", _raw("pegaflow.async_load", "PEGAFLOW_ASYNC_LOAD", extra, env), True)
    model_id = extra.get("pegaflow.model_id")
    return ConnectorSettings(
        addr=node_address(env=env, extra=extra),
        mode=mode,
        save_decode_blocks=save_decode,
        async_load=async_load,
        model_id=str(model_id) if model_id else None,
    )


def render_markdown() -> str:
    """The settings table of docs/connector.md."""
    rows = ["| `kv_connector_extra_config` key | environment variable | default | meaning |",
            "|---|---|---|---|"]
    for s in SETTINGS:
        key = f"`{s.key}`" if s.key else "—"
        env = f"`{s.env}`" if s.env else "—"
        default = (f"`{s.default}`" if s.default_is_value else s.default) if s.default else "—"
        rows.append(f"| {key} | {env} | {default} | {s.meaning} |")
    return "\n".join(rows) + "\n"
