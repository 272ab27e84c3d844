"""The kv-aware routing decision: bounded-load affinity, one code for the router and replay.

``pegaflow router --policy kv-aware`` and ``pegaflow replay --route kv-aware`` both call
:meth:`BoundedLoadKV.choose`; it does no I/O and reads no clock (the caller passes the
loads and, to :class:`RecentLoad`, the time), so replay runs exactly the live decision.

The rule (docs/router.md has the measurements behind the defaults):

1. **Bound.** With ``L`` the candidates' loads (requests), ``n`` their number and ``eps``
   the load bound, an engine may be chosen for its prefix only while
   ``load < ceil((1 + eps) * (sum(L) + 1) / n)``: at most ``(1 + eps)`` times the mean once
   this request is counted (consistent hashing with bounded loads, Mirrokni, Thorup and
   Zadimoghaddam, SODA 2018). At least one engine is always allowed: the least loaded is
   at most the mean, below ``(sum(L) + 1) / n``.
   **Floor.** When an engine would stay below ``(1 - eps)`` times that mean even with this
   request (``load + 1 < (1 - eps) * (sum(L) + 1) / n``), only such engines may be chosen;
   but only once the mean is at least ``1 / eps`` requests (below that, one request is more
   than ``eps`` of the mean: the floor would scatter a light load rather than balance it,
   and the bound's rounding up already leaves no engine idle).
   Without it an engine can starve: with ``eps >= 1 / (n - 1)``, ``n - 1`` engines carry all
   the load under the bound, and an engine that holds less than they do (new after a
   scale-out, or missing the system prompt that every request starts with, which each of
   the others holds) is never the best. On Mooncake's conversation trace (every request
   shares its first block), 8 engines and ``eps`` 0.2, one engine starved and kv-aware kept
   0.82x-0.83x of one shared pool's hits; with the floor, 0.95x-0.98x (docs/router.md).
2. **Value.** Among the allowed engines, the one whose node saves the most prefill: the
   leading prompt tokens it holds, each weighted by what fetching it costs against
   recomputing it (``1 - cost``): an L1 hit costs ``costs.l1`` (0), an SSD hit
   ``costs.ssd``, a pull from a peer node ``costs.remote`` (one cost per
   ``pegaflow.core.tiers.Tier``). Tiers are optional: a caller that knows only "held"
   passes L1 tokens.
3. **Ties** (equal value: no engine holds anything, or several hold the same) go in turn:
   the scan starts just after the engine chosen last, and the first best wins.

"Load" is what the caller measures. The router and replay both use :class:`RecentLoad`:
an engine's load is the larger of its requests in flight and the requests routed to it in
the last ``window`` seconds. In flight alone is near zero at low rates, so it would not stop
a popular prefix from pulling every request to one engine (whose pool then thrashes while
the others idle); the recent count bounds that, and at high rates in flight dominates.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pegaflow.core.tiers import Tier

DEFAULT_LOAD_BOUND = 0.2  # eps: measured in docs/router.md (bench/routing.py --bounds)
DEFAULT_LOAD_WINDOW_S = 60.0


@dataclass(frozen=True)
class TierCosts:
    """Time to get one held token onto the engine, as a fraction of recomputing it (1.0):
    one field per :class:`Tier`, named by its value."""

    l1: float = 0.0  # the engine's own node's DRAM: a local copy
    ssd: float = 0.25  # the node's SSD tier: a read into DRAM first
    remote: float = 0.5  # another node's pool, over the network (router: --peer-hit-cost)

    def __post_init__(self) -> None:
        for tier in Tier:
            v = self.of(tier)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"tier cost {tier} must be in [0, 1], got {v}")

    def of(self, tier: Tier) -> float:
        """The cost of a token held in ``tier``."""
        v: float = getattr(self, tier.value)
        return v

    def saved(self, l1_tokens: float, ssd_tokens: float = 0.0, remote_tokens: float = 0.0) -> float:
        """Prefill tokens' worth of time a holder saves: each held token's (1 - its tier's cost)."""
        return l1_tokens * (1.0 - self.l1) + ssd_tokens * (1.0 - self.ssd) + remote_tokens * (1.0 - self.remote)


class BoundedLoadKV:
    """The kv-aware choice among ``n`` candidates given in a stable order (see the module)."""

    __slots__ = ("load_bound", "costs", "_turn", "redirected", "last_redirected")

    def __init__(self, load_bound: float = DEFAULT_LOAD_BOUND, costs: TierCosts | None = None) -> None:
        if not load_bound >= 0:
            raise ValueError(f"load bound must be >= 0, got {load_bound}")
        self.load_bound = load_bound
        self.costs = costs or TierCosts()
        self._turn = 0
        self.redirected = 0  # choices the bound or the floor moved off the engine that saves the most
        self.last_redirected = False

    def cap(self, loads: Sequence[float]) -> float:
        """Loads strictly below this may be chosen for their prefix."""
        return math.ceil((1.0 + self.load_bound) * (sum(loads) + 1) / len(loads))

    def floor(self, loads: Sequence[float]) -> float:
        """An engine whose load + 1 is strictly below this is under the floor (the module;
        :meth:`choose` applies it only once the mean is at least ``1 / load_bound``)."""
        return (1.0 - self.load_bound) * (sum(loads) + 1) / len(loads)

    def choose(self, loads: Sequence[float], saved: Sequence[float]) -> int:
        """The index of the chosen candidate. ``saved[i]``: what candidate i's node saves
        (:meth:`TierCosts.saved` of the prefix it holds); ``loads[i]``: its load."""
        n = len(loads)
        if n == 0 or len(saved) != n:
            raise ValueError("choose needs one load and one saving per candidate, and a candidate")
        k = self._turn % n
        low = self.floor(loads)
        # Someone is under the floor, and the mean is at least 1 / eps: only they may be chosen.
        if min(loads) + 1 < low and self.load_bound * (sum(loads) + 1) >= n:
            allowed = [load + 1 < low for load in loads]
        else:
            cap = self.cap(loads)
            allowed = [load < cap for load in loads]
        best, best_saved, top = -1, -1.0, -1.0
        for j in range(n):
            i = k + j
            if i >= n:
                i -= n
            v = saved[i]
            if v > top:
                top = v
            if allowed[i] and v > best_saved:
                best, best_saved = i, v
        self.last_redirected = top > best_saved
        if self.last_redirected:
            self.redirected += 1
        self._turn = best + 1  # the next scan starts after the one chosen: equals take turns
        return best


class RecentLoad:
    """Per engine (any hashable key): requests routed within the last ``window`` seconds.

    ``loads`` gives each engine the larger of that count and its requests in flight. Time is
    the caller's (the router's monotonic clock, replay's trace time), so both measure the
    same thing.
    """

    __slots__ = ("window", "_routed")

    def __init__(self, window: float = DEFAULT_LOAD_WINDOW_S) -> None:
        if not window >= 0:
            raise ValueError(f"load window must be >= 0, got {window}")
        self.window = window
        self._routed: dict[Hashable, deque[float]] = {}

    def routed(self, key: Hashable, now: float) -> None:
        if self.window > 0:
            q = self._routed.get(key)
            if q is None:
                q = self._routed[key] = deque()
            q.append(now)

    def recent(self, key: Hashable, now: float) -> int:
        q = self._routed.get(key)
        if not q:
            return 0
        edge = now - self.window
        while q and q[0] <= edge:
            q.popleft()
        return len(q)

    def loads(self, keys: Sequence[Hashable], in_flight: Sequence[int], now: float) -> list[int]:
        """Each engine's load: max(in flight, routed in the window). (``recent`` per key,
        inlined: replay calls this once per request.)"""
        if len(keys) != len(in_flight):
            raise ValueError("one in-flight count per key")
        edge = now - self.window
        get = self._routed.get
        out = []
        for k, f in zip(keys, in_flight):  # noqa: B905 - checked above
            q = get(k)
            if q:
                while q and q[0] <= edge:
                    q.popleft()
                if len(q) > f:
                    f = len(q)
            out.append(f)
        return out
