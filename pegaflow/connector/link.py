"""The connector's link to its node: a down node is a cache miss, never an error.

One ``NodeLink`` per engine process and node (each worker has one; the scheduler process
one per node, several with ``pegaflow.tp_shard_endpoints``). It owns one
``PegaClient`` and registers the namespaces this process uses. While the node is
unreachable every call returns ``None`` at once (the connector treats that as "no hit,
nothing saved", so vLLM recomputes) and a background thread reconnects with exponential
backoff (tenacity). Going down and coming back are logged once each, not per request.

Contract: ``call`` never raises ``NodeUnavailable`` and never blocks on a dead node for
longer than one RPC timeout; ``client`` and ``epoch`` are only meaningful while ``ready``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import urlsplit

import tenacity

from pegaflow.core.hosts import NODE_HOST, NODE_PORT, join_host_port

if TYPE_CHECKING:  # imported when a link starts: a process that never connects does without
    from pegaflow.client import BlockEvents, PegaClient

# A child of vLLM's logger: connector messages go where vLLM's go, in its format and level.
LOGGER_NAME = "vllm.pegaflow"
logger = logging.getLogger(LOGGER_NAME)

T = TypeVar("T")
P = ParamSpec("P")
ExtraConfig = Mapping[str, Any]  # vLLM's kv_connector_extra_config: the user's JSON, each key checked where read

# A scheduler must not stall on a hung node: one RPC waits at most this long.
RPC_TIMEOUT_S = 2.0
# Reconnect backoff: first retry soon (node restarts take ~1 s), then up to every 5 s.
RECONNECT_INITIAL_S = 0.25
RECONNECT_MAX_S = 5.0

ENV_HOST = "PEGAFLOW_HOST"
ENV_PORT = "PEGAFLOW_PORT"
EXTRA_ADDR = "pegaflow.addr"  # HOST:PORT in kv_connector_extra_config
EXTRA_HOST = "pegaflow.host"  # the original's keys
EXTRA_PORT = "pegaflow.port"
DEFAULT_HOST = NODE_HOST
DEFAULT_PORT = NODE_PORT


def node_address(env: Mapping[str, str] | None = None, extra: ExtraConfig | None = None) -> str:
    """``HOST:PORT`` of the node the connector talks to.

    The original's rules and forms: the host from ``PEGAFLOW_HOST``, else the
    ``pegaflow.host`` key of ``kv_connector_extra_config``, else 127.0.0.1; the port from
    ``PEGAFLOW_PORT``, else ``pegaflow.port``, else 50055. A host may be written as a URL
    (``http://127.0.0.1``, the original's documented default) and may carry a port
    (``http://10.0.0.1:50055``), used when no port is given separately. ``pegaflow.addr``
    (``HOST:PORT``) overrides all of them. Raises ValueError for an address it cannot read.
    """
    env = os.environ if env is None else env
    extra = extra or {}
    if extra.get(EXTRA_ADDR):
        host, port = _split(str(extra[EXTRA_ADDR]))
        if port is None:
            raise ValueError(f"{EXTRA_ADDR}={extra[EXTRA_ADDR]!r} has no port (expected HOST:PORT)")
        return join_host_port(host, port)
    host, host_port = _split(str(env.get(ENV_HOST) or extra.get(EXTRA_HOST) or DEFAULT_HOST))
    raw_port = env.get(ENV_PORT) or extra.get(EXTRA_PORT)
    try:
        port = int(raw_port) if raw_port not in (None, "") else host_port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"invalid PegaFlow port {raw_port!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"invalid PegaFlow port {port}")
    return join_host_port(host, port)


def _split(text: str) -> tuple[str, int | None]:
    """(host, port or None) of ``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or a URL of them."""
    t = text.strip()
    if "://" not in t:
        t = "//" + t
    try:
        parts = urlsplit(t)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid PegaFlow address {text!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"invalid PegaFlow address {text!r}")
    return parts.hostname, port


def _client_errors() -> tuple[type[Exception], type[Exception]]:
    from pegaflow.client import NodeError, NodeUnavailable

    return NodeUnavailable, NodeError


def _default_client_factory(addr: str, instance_id: str) -> PegaClient:
    from pegaflow.client import PegaClient

    return PegaClient(addr, instance_id=instance_id, timeout=RPC_TIMEOUT_S)


def query_only_client_factory(
    addr: str, instance_id: str, on_blocks: Callable[[list[BlockEvents], int], None] | None = None
) -> PegaClient:
    """For the scheduler process: it never copies pages, so it does not map the pool.
    ``on_blocks``: receive the node's block events (``PegaClient``)."""
    from pegaflow.client import PegaClient

    return PegaClient(addr, instance_id=instance_id, timeout=RPC_TIMEOUT_S, map_pool=False, on_blocks=on_blocks)


class NodeLink:
    """A registered ``PegaClient`` that survives the node going away and coming back."""

    def __init__(
        self,
        addr: str,
        namespaces: Mapping[str, int],
        instance_id: str,
        *,
        client_factory: Callable[[str, str], PegaClient] = _default_client_factory,
        unavailable: tuple[type[BaseException], ...] | None = None,
        rejected: tuple[type[BaseException], ...] | None = None,
        pci_bus_id: str = "",
    ) -> None:
        self.addr = addr
        self.namespaces = dict(namespaces)
        self.instance_id = instance_id
        self.pci_bus_id = pci_bus_id  # this rank's GPU (worker.pci_bus_id), set on every client it registers
        self._factory = client_factory
        if unavailable is None or rejected is None:
            na, ne = _client_errors()
            unavailable = unavailable or (na, OSError)
            rejected = rejected or (ne,)
        self._unavailable = unavailable
        self._rejected = rejected
        self._logged_rejections: set[str] = set()
        # _lock guards the client while it (re-)registers, which blocks for up to one RPC
        # timeout on a hung node; nothing on a call's path takes it. _thread_lock only
        # guards starting the supervisor, so a failing call never waits on a registration.
        self._lock = threading.Lock()
        self._thread_lock = threading.Lock()
        self._client: PegaClient | None = None
        self._ready = threading.Event()
        self._down = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned_down = False
        if not self._try_connect():
            self._mark_down(None)

    # -- state -----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def client(self) -> PegaClient | None:
        return self._client

    @property
    def node_id(self) -> str:
        """The node's id as its registration answered it ("" while not registered)."""
        c = self._client
        return str(getattr(c, "node_id", "") or "") if c is not None and self._ready.is_set() else ""

    @property
    def epoch(self) -> int:
        """Node epoch the current registration belongs to (0 if the client does not say)."""
        c = self._client
        return int(getattr(c, "epoch", 0) or 0) if c is not None else -1

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    # -- calls -----------------------------------------------------------------------------
    def call(self, fn: Callable[Concatenate[PegaClient, P], T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """``fn(client, *args, **kwargs)``, or ``None`` if the node is (or just went) unavailable or
        refused the call. ``fn`` runs before this returns: a loop's values reach it as ``args``."""
        if not self._ready.is_set():
            return None
        client = self._client  # read once: close() on another thread may clear it since the check
        if client is None:
            return None
        try:
            return fn(client, *args, **kwargs)
        except self._unavailable as exc:
            self._mark_down(exc)
            return None
        except self._rejected as exc:
            # The node refused the request: a bug on one side, but still only a miss here.
            kind = str(exc).split(":", 1)[0]
            if kind not in self._logged_rejections:
                self._logged_rejections.add(kind)
                logger.error("PegaFlow node %s rejected a request: %s", self.addr, exc)
            return None

    def reconnect(self) -> None:
        """Force a re-registration in the background (e.g. the pool epoch looks stale)."""
        self._mark_down(None, quiet=True)

    def close(self) -> None:
        self._stop.set()
        self._ready.clear()
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass

    # -- internals -------------------------------------------------------------------------
    def _try_connect(self) -> bool:
        try:
            self._connect_once()
            return True
        except self._unavailable:
            return False

    def _connect_once(self) -> None:
        with self._lock:
            if self._client is None:
                self._client = self._factory(self.addr, self.instance_id)
                if self.pci_bus_id:
                    self._client.pci_bus_id = self.pci_bus_id  # sent at Register (NUMA placement)
            client = self._client
            try:
                client.register(self.namespaces)
                failure: BaseException | None = None
            except BaseException as exc:  # re-raised below, once the lock is free
                self._client = None
                failure = exc
        if failure is not None:
            try:  # closing the client of a hung node blocks too: never under the lock
                client.close()
            except Exception:  # noqa: BLE001
                pass
            raise failure
        self._down.clear()
        self._ready.set()
        if self._warned_down:
            logger.warning("PegaFlow node %s is back (epoch %s); external KV cache resumes", self.addr, self.epoch)
            self._warned_down = False

    def _mark_down(self, exc: BaseException | None, quiet: bool = False) -> None:
        self._ready.clear()
        self._down.set()
        if not self._warned_down and not quiet:
            logger.warning(
                "PegaFlow node %s unavailable (%s); serving by recomputation and reconnecting with backoff",
                self.addr,
                exc or "not reachable",
            )
            self._warned_down = True
        with self._thread_lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._supervise, name="pegaflow-reconnect", daemon=True)
                self._thread.start()

    def _pause(self, seconds: float) -> None:
        """The backoff's sleep: over at once when the link is stopped."""
        self._stop.wait(seconds)

    def _supervise(self) -> None:
        """Reconnect whenever the link is down, with exponential backoff and jitter."""
        while not self._stop.is_set():
            self._down.wait(timeout=1.0)
            if not self._down.is_set() or self._stop.is_set():
                continue
            retrying = tenacity.Retrying(
                wait=tenacity.wait_exponential(multiplier=RECONNECT_INITIAL_S, max=RECONNECT_MAX_S)
                + tenacity.wait_random(0, RECONNECT_INITIAL_S),
                retry=tenacity.retry_if_exception_type(self._unavailable),
                stop=tenacity.stop_when_event_set(self._stop),
                sleep=self._pause,
                reraise=False,
            )
            try:
                for attempt in retrying:
                    with attempt:
                        self._connect_once()
            except tenacity.RetryError:
                return
            except Exception:  # noqa: BLE001 - a bug in register must not kill the supervisor
                logger.exception("PegaFlow reconnect failed unexpectedly; retrying")
                self._stop.wait(RECONNECT_MAX_S)
