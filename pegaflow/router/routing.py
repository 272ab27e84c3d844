"""Routing policies: what the router knows about its candidates, and the choice.

``kv-aware`` is :class:`~pegaflow.policy.routing.BoundedLoadKV`, the decision ``pegaflow
replay --route kv-aware`` runs too: among the engines whose load is within ``load_bound``
of the mean (this request counted), the one whose node holds the longest prefix of the
prompt, each held token weighted by its tier's cost (L1, SSD, a peer's pool); ties in turn.
An engine's load is :class:`~pegaflow.policy.routing.RecentLoad`'s: the larger of its
requests in flight (this router's, or vLLM's own queue when higher) and the requests this
router sent it in the last ``load_window`` seconds. docs/router.md has the measurements.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pegaflow.policy.routing import (
    DEFAULT_LOAD_BOUND,
    DEFAULT_LOAD_WINDOW_S,
    BoundedLoadKV,
    RecentLoad,
    TierCosts,
)

ROUND_ROBIN = "round-robin"
LEAST_LOADED = "least-loaded"
KV_AWARE = "kv-aware"
POLICIES = (KV_AWARE, LEAST_LOADED, ROUND_ROBIN)


@dataclass(frozen=True)
class Candidate:
    """One healthy engine as a policy sees it."""

    url: str
    in_flight: int = 0  # this router's requests on it, not finished
    queued_tokens: int = 0  # prompt tokens this router sent it that have no first token yet
    engine_queue: int = 0  # vLLM's running + waiting requests (its /metrics; other clients too)
    prefix_tokens: int = 0  # leading tokens of this prompt its node holds, whole blocks (kv-aware)
    ssd_tokens: int = 0  # of those, the ones only on its node's SSD tier (when the hint says)
    remote_tokens: int = 0  # further leading tokens another node holds, which it would pull

    @property
    def load(self) -> int:
        """Requests on the engine: ours as counted now, or its own count if that is higher."""
        return max(self.in_flight, self.engine_queue)


@dataclass(frozen=True)
class Decision:
    url: str
    prefix_tokens: int  # the chosen engine's node holds this many leading tokens of the prompt
    cost: float  # kv-aware: the estimated prefill tokens (not held, tier costs added); else the load
    hinted: bool = True  # kv-aware: the prefix answer was used (False: none in time, routed by load)


class Policy:
    """``choose`` takes the healthy candidates (never empty) and the prompt's size."""

    def __init__(self, name: str, load_bound: float = DEFAULT_LOAD_BOUND,
                 load_window: float = DEFAULT_LOAD_WINDOW_S, costs: TierCosts | None = None) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
        self.name = name
        self.kv = BoundedLoadKV(load_bound, costs)
        self.recent = RecentLoad(load_window)
        self.last_loads: dict[str, int] = {}  # kv-aware: the loads the last choice saw, per engine
        self._turn = 0

    @property
    def wants_prefixes(self) -> bool:
        return self.name == KV_AWARE

    def _rotated(self, cands: Sequence[Candidate]) -> list[Candidate]:
        """The candidates starting at this call's turn (ties rotate instead of piling up)."""
        ordered = sorted(cands, key=lambda c: c.url)
        k = self._turn % len(ordered)
        self._turn += 1
        return ordered[k:] + ordered[:k]

    def saved(self, c: Candidate, prompt_tokens: int) -> float:
        """Prefill tokens' worth of time the engine's node saves this prompt (tier-weighted)."""
        held = min(prompt_tokens, c.prefix_tokens)
        ssd = min(held, c.ssd_tokens)
        remote = max(0, min(prompt_tokens - held, c.remote_tokens))
        return self.kv.costs.saved(held - ssd, ssd, remote)

    def choose(self, cands: Sequence[Candidate], prompt_tokens: int = 0, use_prefixes: bool = True,
               now: float | None = None) -> Decision:
        """The engine for one request. ``use_prefixes=False`` (no prefix answer in time, or
        no token ids): kv-aware sees no prefix anywhere, so the bound and the turn decide."""
        if not cands:
            raise ValueError("no candidates")
        if self.name == KV_AWARE:
            now = time.monotonic() if now is None else now
            ordered = sorted(cands, key=lambda c: c.url)
            urls = [c.url for c in ordered]
            loads = self.recent.loads(urls, [c.load for c in ordered], now)
            saved = [self.saved(c, prompt_tokens) if use_prefixes else 0.0 for c in ordered]
            i = self.kv.choose(loads, saved)
            self.last_loads = dict(zip(urls, loads, strict=True))
            self.recent.routed(urls[i], now)
            c = ordered[i]
            return Decision(c.url, c.prefix_tokens if use_prefixes else 0, max(0.0, prompt_tokens - saved[i]),
                            use_prefixes)
        order = self._rotated(cands)
        if self.name == ROUND_ROBIN:
            c = order[0]
            return Decision(c.url, c.prefix_tokens, float(c.load))
        best = min(order, key=lambda c: (c.load, c.queued_tokens))
        return Decision(best.url, best.prefix_tokens, float(best.load))
