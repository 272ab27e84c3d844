"""The connector's settings: every ``kv_connector_extra_config`` key and environment variable.

One table (``SETTINGS``) names each setting once: its ``kv_connector_extra_config`` key, its
environment variable, its default, what it does here and, for those of the original's
release we match (``ORIGINAL_RELEASE``), what it did there. ``load_settings`` reads them into
a typed ``ConnectorSettings`` (the connector never looks at the raw dict again);
``render_markdown`` and ``render_original_markdown`` write the tables of docs/connector.md (a
unit test fails when the page is stale). Precedence, as in the original: environment >
``kv_connector_extra_config`` > default; ``pegaflow.addr`` overrides host and port (see
``link.node_address``) and ``pegaflow.tp_shard_endpoints`` all three.

The original's users paste their ``kv_connector_extra_config`` unchanged: every key of the
original is read, and a key that does nothing here is named in one start-up line
(``log_settings``). A ``pegaflow.*`` key that no row reads is a warning naming the nearest
known key, so a typo never silently changes nothing.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pegaflow.connector.link import LOGGER_NAME, ExtraConfig, node_address
from pegaflow.connector.placement import TP_SHARD_ENDPOINTS
from pegaflow.core.hosts import NODE_ADDR, NODE_HOST, NODE_PORT

logger = logging.getLogger(LOGGER_NAME)

ORIGINAL_RELEASE = "0.25.1"  # the original's release whose keys and variables are read here
KEY_PREFIX = "pegaflow."  # every key of ours and the original's starts with it

READ_WRITE = "read_write"
SAVE_ONLY = "save_only"  # a prefill engine: computes and saves, never loads
LOAD_ONLY = "load_only"  # a decode engine: loads what prefill saved, never saves
MODES = (READ_WRITE, SAVE_ONLY, LOAD_ONLY)
TRANSFER_BACKENDS = ("direct", "kernel")  # the original's pegaflow.transfer_backend values


@dataclass(frozen=True)
class Setting:
    key: str | None  # kv_connector_extra_config key (None: environment only)
    env: str | None  # environment variable (None: extra config only)
    default: str
    meaning: str  # what it does here
    default_is_value: bool = True  # False: ``default`` describes it in words (not code-formatted)
    original: str = ""  # what it did in ORIGINAL_RELEASE ("": not the original's)
    here: str = ""  # in a word or a line, what it does here, for the original's table
    inert: bool = False  # it does nothing here: named in the start-up line when set


_COPIES = ("the worker's copies are always batched: on a GPU one gather kernel into a staging "
           "buffer and one DMA per run of pool pages, on a CPU a memcpy kernel (`PEGAFLOW_COPY_KERNEL`)")
_TAIL = ("only full blocks are stored; a decode engine recomputes the prompt's last partial block "
         "(less than one block of tokens)")

SETTINGS: tuple[Setting, ...] = (
    Setting("pegaflow.host", "PEGAFLOW_HOST", NODE_HOST,
            "Node host; also `http://HOST` or `http://HOST:PORT` (the original's form).",
            original="Node host (`http://127.0.0.1`); `PEGAFLOW_HOST` first.", here="The same."),
    Setting("pegaflow.port", "PEGAFLOW_PORT", str(NODE_PORT), "Node gRPC port.",
            original="Node gRPC port (50055); `PEGAFLOW_PORT` first.", here="The same."),
    Setting("pegaflow.addr", None, "",
            "`HOST:PORT` of the node; overrides host and port when set."),
    Setting("pegaflow.tp_shard_endpoints", None, "",
            "Node addresses in global TP-rank order, for one engine's TP ranks on several hosts "
            "(a JSON list, e.g. `[\"http://host-a:50055\", \"http://host-b:50055\"]`; it overrides "
            "host, port and addr). The TP ranks are split into as many equal contiguous groups as "
            "addresses, and group g copies to and from the node at address g; the scheduler side "
            "registers with every node, queries each, loads the prefix all of them hold (the shortest "
            "of their hits) and sends each lease, reservation and commit to the node that issued it; "
            "a node that is down makes every request recompute. The TP size must divide by the "
            "number of addresses, and several need TP-only parallelism (no pipeline or context "
            "parallelism): else the connector is disabled with one line.",
            original="One node per equal contiguous group of TP ranks; the scheduler queried every "
                     "shard and loaded the prefix all of them held.",
            here="The same."),
    Setting("pegaflow.mode", "PEGAFLOW_MODE", READ_WRITE,
            "`read_write`; `save_only` (a prefill engine: saves, never loads); "
            "`load_only` (a decode engine: loads, never saves).",
            original="`read_write` or `save_only` (the key only).",
            here="The same, also from `PEGAFLOW_MODE`; also `load_only`."),
    Setting("pegaflow.save_decode_blocks", "PEGAFLOW_SAVE_DECODE_BLOCKS", "true",
            "Also save the full blocks of generated tokens, so the next turn of a conversation "
            "hits its previous answer; `false` saves prompt blocks only."),
    Setting("pegaflow.async_load", "PEGAFLOW_ASYNC_LOAD", "true",
            "While the node promotes a request's blocks from SSD or pulls them from a peer, tell "
            "vLLM the load is asynchronous (it runs other requests and is told when the copy is "
            "done); `false` keeps the request waiting (re-asked every 5 ms). Engines with several "
            "KV cache groups always load asynchronously."),
    Setting("pegaflow.wait_for_full_prefix", None, "false",
            "A request waits until the node holds every full block of its prompt, or will once "
            "its SSD tier or a peer delivered them (no asynchronous load of part of the prompt is "
            "promised meanwhile), asked again every 5 ms for at most 2 s (the one wait rule, see "
            "Loads that wait); then it goes on as without the key: it loads what there is and "
            "recomputes the rest. Meant for a decode engine whose prefill engine stores the "
            "prompt: elsewhere a request whose prompt is not stored waits the 2 s first.",
            original="Kept a query loading until a remote node held the whole remaining prefix, "
                     "fetched by RDMA (up to 30 s); no effect without RDMA.",
            here="Waits for the whole prompt from any tier, up to 2 s."),
    Setting("pegaflow.model_id", None, "the model path",
            "The model's name in the namespace, when the same weights live at different paths "
            "on different hosts.", default_is_value=False),
    Setting("pegaflow.transfer_backend", None, "",
            f"Checked (`{'`, `'.join(TRANSFER_BACKENDS)}`; anything else disables the connector, "
            f"with the original's message); no effect: {_COPIES}.",
            original="GPU copy engine: `direct` (a DMA per block) or `kernel` (one copy kernel; "
                     "MLA's default); anything else refused.",
            here=f"No effect: {_COPIES}.", inert=True),
    Setting("pegaflow.pd_tail_save", None, "false", f"No effect: {_TAIL}.",
            original="A prefill engine also saved the prompt's partial last block, under vLLM's own "
                     "hash (needs `PYTHONHASHSEED`).",
            here=f"No effect: {_TAIL}.", inert=True),
    Setting("pegaflow.pd_tail_load", None, "false", f"No effect: {_TAIL}.",
            original="A decode engine loaded that partial block.",
            here=f"No effect: {_TAIL}.", inert=True),
    Setting(None, "PEGAFLOW_CROSS_LAYER_BLOCKS", "1",
            "`0`: keep vLLM's per-layer KV cache tensors instead of asking vLLM 0.20-0.28 for one "
            "tensor with every layer of a block in one run (`prefer_cross_layer_blocks`); later "
            "vLLMs choose the layout themselves.",
            original="`1` (the default): ask vLLM for one cross-layer KV cache tensor (not for MLA or "
                     "several KV cache groups); any other value: per-layer tensors.",
            here="The same for `0` and `1`; `false`, `no`, `off` are off too, and a value that is not "
                 "a boolean disables the connector (one line)."),
    Setting(None, "PEGAFLOW_INSTANCE_ID", "`HOST:PID:scheduler`, `HOST:PID:worker:RANK`",
            "The engine's name on its node (`pegaflow status`, `/instances`, `pegaflow cache clear "
            "--instance`): every process of the engine registers under it, `ID_dpN` for data-parallel "
            "rank N. A `kv_transfer_config.engine_id` the user gave (not vLLM's random UUID) names it "
            "first, as in the original.", default_is_value=False,
            original="The instance id when vLLM gave none; vLLM always gives one "
                     "(`kv_transfer_config.engine_id`, a random UUID unless set), so it was not read.",
            here="Names the engine on its node, after a user-given `engine_id`."),
    Setting(None, "PEGA_LOAD_TIMEOUT_SECONDS", "", "No effect: a load is waited for by the one wait "
            "rule (2 s, Loads that wait); then what did not arrive is recomputed.",
            original="How long a worker waited for a load (120 s, at least 30).",
            here="No effect: loads wait at most 2 s.", inert=True),
    Setting(None, "PEGAFLOW_COPY_KERNEL", "measured",
            "Force the page-copy kernel (`memcpy`, `nt-avx2`, `nt-sse2`, a `-2t` suffix for two "
            "threads) instead of measuring the candidates on the first large copies.", default_is_value=False),
)

KNOWN_KEYS: frozenset[str] = frozenset(s.key for s in SETTINGS if s.key)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class ConnectorSettings:
    addr: str = NODE_ADDR
    # pegaflow.tp_shard_endpoints: one node per group of TP ranks (``()``: every rank uses ``addr``)
    tp_nodes: tuple[str, ...] = ()
    mode: str = READ_WRITE
    save_decode_blocks: bool = True
    async_load: bool = True
    model_id: str | None = None
    wait_for_full_prefix: bool = False  # every request waits for its whole prompt (bounded)
    instance_id: str | None = None  # PEGAFLOW_INSTANCE_ID: the engine's name on its node
    cross_layer_blocks: bool = True  # PEGAFLOW_CROSS_LAYER_BLOCKS

    @property
    def nodes(self) -> tuple[str, ...]:
        """The node of each group of TP ranks, in rank order (one node: every rank's)."""
        return self.tp_nodes or (self.addr,)

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


def cross_layer_blocks(env: Mapping[str, str] | None = None) -> bool:
    """``PEGAFLOW_CROSS_LAYER_BLOCKS`` (default on). Raises ``ValueError`` for a non-boolean."""
    env = os.environ if env is None else env
    return _bool("PEGAFLOW_CROSS_LAYER_BLOCKS", env.get("PEGAFLOW_CROSS_LAYER_BLOCKS"), True)


def prefers_cross_layer_blocks() -> bool:
    """``PEGAFLOW_CROSS_LAYER_BLOCKS`` for vLLM's ``prefer_cross_layer_blocks``, asked after start:
    on when it cannot be read (the connector disabled itself at start, saying why)."""
    try:
        return cross_layer_blocks()
    except ValueError:
        return True


def transfer_backend(value: object) -> str | None:
    """The original's ``pegaflow.transfer_backend`` check (its message too); None when unset."""
    if value is None:
        return None
    normalized = str(value).strip().lower()
    if normalized not in TRANSFER_BACKENDS:
        raise ValueError(f"Unsupported pegaflow.transfer_backend {value!r}; "
                         f"expected one of: {', '.join(TRANSFER_BACKENDS)}")
    return normalized


def tp_shard_nodes(value: object) -> tuple[str, ...]:
    """The node addresses ``pegaflow.tp_shard_endpoints`` names, in TP-rank group order (``()``
    when unset), checked as the original checks them (and with its messages). Whether the TP
    size divides by them is checked where the TP size is known (``Placement.of``)."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{TP_SHARD_ENDPOINTS} must be a list of endpoints")
    if not value or any(not isinstance(e, str) or not e for e in value):
        raise ValueError(f"{TP_SHARD_ENDPOINTS} must contain non-empty strings")
    if len(set(value)) != len(value):
        raise ValueError(f"{TP_SHARD_ENDPOINTS} must not contain duplicates")
    addrs = tuple(node_address(env={}, extra={"pegaflow.host": e}) for e in value)
    if len(set(addrs)) != len(addrs):
        raise ValueError(f"{TP_SHARD_ENDPOINTS} must not contain duplicates ({', '.join(addrs)})")
    return addrs


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
    transfer_backend(extra.get("pegaflow.transfer_backend"))  # checked as the original does; no effect
    tp_nodes = tp_shard_nodes(extra.get(TP_SHARD_ENDPOINTS))
    return ConnectorSettings(
        addr=tp_nodes[0] if tp_nodes else node_address(env=env, extra=extra),
        tp_nodes=tp_nodes if len(tp_nodes) > 1 else (),
        mode=mode,
        save_decode_blocks=save_decode,
        async_load=async_load,
        model_id=str(model_id) if model_id else None,
        wait_for_full_prefix=_bool("pegaflow.wait_for_full_prefix", extra.get("pegaflow.wait_for_full_prefix"), False),
        instance_id=env.get("PEGAFLOW_INSTANCE_ID", "").strip() or None,
        cross_layer_blocks=cross_layer_blocks(env),
    )


def unknown_keys(extra: ExtraConfig) -> dict[str, str | None]:
    """Each ``pegaflow.*`` key of ``extra`` that no setting reads, with the nearest known key
    (None when none is near)."""
    names = sorted(k.removeprefix(KEY_PREFIX) for k in KNOWN_KEYS)  # the shared prefix says nothing
    out: dict[str, str | None] = {}
    for key in extra:
        if isinstance(key, str) and key.startswith(KEY_PREFIX) and key not in KNOWN_KEYS:
            near = difflib.get_close_matches(key.removeprefix(KEY_PREFIX), names, n=1)
            out[key] = KEY_PREFIX + near[0] if near else None
    return out


def inert_settings(extra: ExtraConfig, env: Mapping[str, str]) -> list[str]:
    """``NAME=value: what it does here`` for each setting that is set and does nothing here."""
    out = []
    for s in SETTINGS:
        if not s.inert:
            continue
        if s.env and env.get(s.env) not in (None, ""):
            out.append(f"{s.env}={env[s.env]!r}: {s.here}")
        elif s.key and s.key in extra:
            out.append(f"{s.key}={extra[s.key]!r}: {s.here}")
    return out


def log_settings(extra: ExtraConfig, env: Mapping[str, str] | None = None) -> None:
    """At start: a warning per unknown ``pegaflow.*`` key (naming the nearest known one), and
    one line naming the settings that are set and do nothing here."""
    env = os.environ if env is None else env
    for key, near in unknown_keys(extra).items():
        hint = f"did you mean {near!r}?" if near else "the known keys are in docs/connector.md"
        logger.warning("PegaFlow: unknown kv_connector_extra_config key %r is ignored (%s)", key, hint)
    inert = inert_settings(extra, env)
    if inert:
        logger.info("PegaFlow: settings of the original (%s) with no effect here: %s", ORIGINAL_RELEASE,
                    "; ".join(inert).replace("`", ""))


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


def render_original_markdown() -> str:
    """The table of docs/connector.md of the original's keys and variables (``ORIGINAL_RELEASE``)."""
    rows = [f"| key or variable of the original ({ORIGINAL_RELEASE}) | what it did there | here |", "|---|---|---|"]
    for s in SETTINGS:
        if s.original:
            rows.append(f"| `{s.key or s.env}` | {s.original} | {s.here} |")
    return "\n".join(rows) + "\n"
