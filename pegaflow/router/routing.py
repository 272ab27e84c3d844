"""Routing policies: pure functions of what the router knows about its candidates.

``kv-aware`` estimates the prefill work a request costs on each engine and takes the
least: ``overlap_weight x (prompt tokens the engine's node does not hold) + (prompt tokens
already queued on the engine, not yet past their first token)``. With the weight at 1 both
terms are tokens of prefill the engine must run before this request's first token, so the
choice minimises the estimated time to first token. Ties go to the engine with fewer
requests in flight, then in turn. Engines sharing one node (one host's shared pool) hold
the same prefix, so among them this is least-loaded; across hosts it prefers the host
that holds the prefix unless its queue outweighs the recomputation (docs/router.md
compares this with Dynamo's KV router and llm-d's scorers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    @property
    def load(self) -> int:
        """Requests on the engine: ours as counted now, or its own count if that is higher."""
        return max(self.in_flight, self.engine_queue)


@dataclass(frozen=True)
class Decision:
    url: str
    prefix_tokens: int  # the chosen engine's node holds this many leading tokens of the prompt
    cost: float  # kv-aware: the estimated prefill tokens; else the load


class Policy:
    """``choose`` takes the healthy candidates (never empty) and the prompt's size."""

    def __init__(self, name: str, overlap_weight: float = 1.0) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
        if overlap_weight < 0:
            raise ValueError("overlap_weight must be >= 0")
        self.name = name
        self.overlap_weight = overlap_weight
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

    def cost(self, c: Candidate, prompt_tokens: int) -> float:
        held = min(prompt_tokens, c.prefix_tokens)
        return self.overlap_weight * (prompt_tokens - held) + c.queued_tokens

    def choose(self, cands: Sequence[Candidate], prompt_tokens: int = 0, use_prefixes: bool = True) -> Decision:
        """The engine for one request. ``use_prefixes=False`` (no prefix answer in time, or
        no token ids): kv-aware routes by load alone, as least-loaded does."""
        if not cands:
            raise ValueError("no candidates")
        order = self._rotated(cands)
        if self.name == ROUND_ROBIN:
            c = order[0]
            return Decision(c.url, c.prefix_tokens, float(c.load))
        if self.name == KV_AWARE and use_prefixes:
            # min() keeps the first of equals: the rotation breaks the remaining ties.
            best = min(order, key=lambda c: (self.cost(c, prompt_tokens), c.load))
            return Decision(best.url, best.prefix_tokens, self.cost(best, prompt_tokens))
        best = min(order, key=lambda c: (c.load, c.queued_tokens))
        return Decision(best.url, best.prefix_tokens, float(best.load))
