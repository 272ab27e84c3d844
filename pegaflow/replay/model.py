"""The cache model ``pegaflow replay`` drives: pools of the node's own ``BlockIndex``.

What is modelled, and how (also in ``docs/replay.md``):

- **L1** is one :class:`~pegaflow.core.block_index.BlockIndex` per pool, with the node's
  LRU eviction and, when asked, the node's TinyLFU admission
  (:class:`~pegaflow.policy.tinylfu.TinyLFU`, sized to the L1 capacity in blocks). A
  request is served exactly as the node serves it: ``prefix`` (hits are touched and
  recorded), ``record_access`` for the rest, then ``reserve`` + ``commit`` of the blocks
  the engine computed (the node's Query, Reserve, Commit), in one pass
  (``BlockIndex.insert``: the same rules, victims and events as the two calls).
- **SSD** is a second ``BlockIndex`` per pool (plain LRU). With ``ssd_writes="evictions"``
  it receives every block evicted from L1 (a victim tier); with ``"commits"`` every block
  committed into L1, as the node's write-behind does. Writes land after the request; a
  block already there is refreshed, not rewritten. A prefix continues across tiers:
  after L1's run, the SSD's run, then L1 again, and so on. SSD hits are promoted into L1
  like freshly computed blocks and stay on the SSD. (The node's SSD index is a segment
  log, FIFO with reinsertion of reused blocks, behind a bounded write queue; LRU is the
  model here.)
- **Capacity** is in blocks (every page one unit, ``align=1``), in bytes (pages of the
  namespace's size, 4096-aligned as in the node) or a percentage of the trace's distinct
  blocks. Pools whose pages all have one size use :class:`UniformAllocator`; pools that
  mix page sizes use the node's ``ExtentAllocator``.
- **Namespace quotas** (``--namespace-quota``): L1's ``BlockIndex`` gets the node's
  :class:`~pegaflow.policy.quota.Quotas`, sized on each pool's L1 capacity (in blocks or
  bytes, as the capacity is), so the victim rule is the node's. The SSD tier has none (the
  node's SSD tier has none either).
- **Instances**: with ``shared`` pools every instance uses one pool of the whole capacity
  (PegaFlow: one node per host); with ``isolated`` pools instance i has its own pool of
  ``capacity / instances`` (the same memory, split). Requests go to instances round-robin,
  by a stable hash of a trace field (equal field values always land together), or
  ``kv-aware``: ``pegaflow router``'s own decision
  (:class:`~pegaflow.policy.routing.BoundedLoadKV`), fed what the router would see: each
  instance's load (:class:`~pegaflow.policy.routing.RecentLoad` over the time model below)
  and the prefix each instance's pool holds, asked without touching anything (the node's
  ``peek`` Query), L1 then SSD, weighted by the tier costs.
- **Time** (:class:`TimeModel`): a request arrives at its trace timestamp. Each instance
  prefills one request at a time, in arrival order: ``prefill_us_per_token`` for each prompt
  token its pool did not hold, and ``ssd_cost`` of that for each token read from the SSD
  tier (L1 hits cost nothing). A request waits in its instance's queue until the previous
  prefill ends (its queueing delay), holds its first token after its own prefill, and is in
  flight ``decode_s`` longer (decode is batched: it does not hold up the next prefill). The
  cache is looked up when the request is routed, in trace order (:meth:`Pool.query`; SSD
  hits are read into L1 then); the blocks the engine computed are committed
  (:meth:`Pool.commit`) at the request's completion: its measured ``done`` from the trace,
  else its modelled end of prefill with ``commit_at_prefill_end``, else its arrival (zero
  service time: exactly :meth:`Pool.serve`, the query and the commit at once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pegaflow.config.capacity import KV_AWARE, ROUND_ROBIN, Capacity, route_field
from pegaflow.core.allocator import OutOfSpace
from pegaflow.core.block_index import BlockIndex, IndexEvent, Namespace
from pegaflow.core.tiers import LOCAL_TIERS, Tier
from pegaflow.policy.quota import Quota, Quotas
from pegaflow.policy.routing import (
    DEFAULT_LOAD_BOUND,
    DEFAULT_LOAD_WINDOW_S,
    BoundedLoadKV,
    RecentLoad,
    TierCosts,
)
from pegaflow.policy.tinylfu import TinyLFU

# The node's default --page-align: O_DIRECT needs 4096-byte aligned pages.
BYTES_ALIGN = 4096
SHARED = "shared"
ISOLATED = "isolated"
SSD_WRITES_EVICTIONS = "evictions"  # the SSD tier is L1's victim cache
SSD_WRITES_COMMITS = "commits"  # every block committed into L1 is also written (write-behind)
SSD_WRITES = (SSD_WRITES_EVICTIONS, SSD_WRITES_COMMITS)


class UniformAllocator:
    """Constant-time page allocator for a pool whose pages all have one size.

    Same contract as the node's ``ExtentAllocator`` for that case: pages are
    ``round(size)`` bytes at multiples of it, ``capacity // page`` of them fit, and
    ``free_bytes + allocated == capacity``. A page larger than the slot is refused.
    """

    __slots__ = ("align", "page", "capacity", "free_bytes", "_next", "_free")

    def __init__(self, capacity: int, page_bytes: int, align: int = 1) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be > 0, got {page_bytes}")
        self.align = align
        self.page = (page_bytes + align - 1) // align * align
        self.capacity = capacity - capacity % self.page
        self.free_bytes = self.capacity
        self._next = 0
        self._free: list[int] = []

    @property
    def used_bytes(self) -> int:
        return self.capacity - self.free_bytes

    def round(self, size: int) -> int:
        return self.page

    def alloc(self, size: int) -> int:
        if size > self.page:
            raise ValueError(f"page of {size} bytes exceeds the uniform page of {self.page}")
        if self._free:
            off = self._free.pop()
        elif self._next < self.capacity:
            off = self._next
            self._next += self.page
        else:
            raise OutOfSpace(size)
        self.free_bytes -= self.page
        return off

    def free(self, offset: int, size: int) -> None:
        self._free.append(offset)
        self.free_bytes += self.page


class TierIndex:
    """One BlockIndex sized from a :class:`Capacity`, with its namespaces registered.

    ``capacity_blocks`` (which also sizes TinyLFU) is exact for one page size and an
    estimate (capacity / mean page size) when namespaces mix page sizes.
    """

    def __init__(
        self, amount: int, in_blocks: bool, page_bytes: dict[str, int], admission: bool = False,
        quotas: Quotas | None = None,
    ) -> None:
        sizes = {1} if in_blocks else set(page_bytes.values())
        align = 1 if in_blocks else BYTES_ALIGN
        if len(sizes) <= 1:
            page = next(iter(sizes), 1)
            alloc = UniformAllocator(amount, page, align)
            entries = amount // alloc.page
            self.index = BlockIndex(amount, align, allocator=alloc, quotas=quotas)
        else:
            mean = sum(sizes) / len(sizes)
            entries = int(amount // mean)
            self.index = BlockIndex(amount, align, quotas=quotas)
        self.capacity_blocks = entries
        self.admission: TinyLFU | None = TinyLFU(max(1, entries)) if admission else None
        self.index.admission = self.admission
        self.ns: dict[str, Namespace] = {
            name: self.index.namespace(name, 1 if in_blocks else size) for name, size in page_bytes.items()
        }


class Pool:
    """One node's cache: L1 and, if sized, the SSD tier (see the module docstring)."""

    def __init__(
        self,
        l1: tuple[int, bool],
        ssd: tuple[int, bool],
        page_bytes: dict[str, int],
        tinylfu: bool,
        ssd_writes: str = SSD_WRITES_EVICTIONS,
        quotas: Quotas | None = None,
    ) -> None:
        if ssd_writes not in SSD_WRITES:
            raise ValueError(f"ssd_writes must be one of {SSD_WRITES}, got {ssd_writes!r}")
        self.l1 = TierIndex(*l1, page_bytes, admission=tinylfu, quotas=quotas)
        self.ssd: TierIndex | None = None
        self._to_ssd: list[tuple[str, list[bytes]]] = []
        self._ssd_op = IndexEvent.EVICT if ssd_writes == SSD_WRITES_EVICTIONS else IndexEvent.INSERT
        if ssd[0] > 0:
            self.ssd = TierIndex(*ssd, page_bytes)
            self.l1.index.add_listener(self._on_l1_event)

    def _on_l1_event(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        if op is self._ssd_op:
            self._to_ssd.append((ns.name, hashes))

    def serve(self, namespace: str, hashes: list[bytes], saved: list[bytes] | None = None
              ) -> tuple[int, list[tuple[int, int]]]:
        """Serve one request; returns (prefix hit blocks, SSD runs as (start, end) pairs).
        ``saved``: blocks the engine then stores beyond the queried ones (a Reserve + Commit
        without a Query: inserted, not recorded as accesses). The Query and the commit of
        what the request brought at once (:meth:`query` then :meth:`commit`)."""
        hit, runs, promoted, computed = self.query(namespace, hashes)
        self.commit(namespace, promoted + computed if promoted else computed, saved)
        return hit, runs

    def query(self, namespace: str, hashes: list[bytes]
              ) -> tuple[int, list[tuple[int, int]], list[bytes], list[bytes]]:
        """The node's Query at the request's arrival: the prefix across tiers, its L1 hits
        touched and every block not hit in L1 recorded as an access. Returns (prefix hit
        blocks, SSD runs as (start, end) pairs, the blocks hit on the SSD (to promote into
        L1), the blocks the engine computes); nothing is inserted (:meth:`commit` does)."""
        l1 = self.l1.index
        ns = self.l1.ns[namespace]
        n = len(hashes)
        pos = len(l1.prefix(ns, hashes))
        if pos == n:
            return n, [], [], []
        if self.ssd is None:
            rest = hashes[pos:]
            l1.record_access(ns, rest)
            return pos, [], [], rest
        ssd = self.ssd.index
        sns = self.ssd.ns[namespace]
        runs: list[tuple[int, int]] = []
        promoted: list[bytes] = []
        while pos < n:
            got = len(ssd.prefix(sns, hashes[pos:]))
            if not got:
                break
            runs.append((pos, pos + got))
            promoted += hashes[pos : pos + got]
            pos += got
            pos += len(l1.prefix(ns, hashes[pos:]))
        computed = hashes[pos:]
        l1.record_access(ns, promoted + computed)
        return pos, runs, promoted, computed

    def commit(self, namespace: str, store: list[bytes], saved: list[bytes] | None = None) -> None:
        """Reserve + Commit of ``store`` (then ``saved``) into L1, and the SSD tier's writes
        that causes: when the request's blocks become visible."""
        if store:
            self.l1.index.insert(self.l1.ns[namespace], store)
            self._flush_ssd()
        if saved:
            self.l1.index.insert(self.l1.ns[namespace], saved)
            self._flush_ssd()

    def _flush_ssd(self) -> None:
        """Write what L1 handed to the SSD tier during this request."""
        if self._to_ssd and self.ssd is not None:
            ssd = self.ssd.index
            for name, hs in self._to_ssd:
                ssd.insert(self.ssd.ns[name], hs)
            self._to_ssd.clear()


@dataclass(frozen=True)
class TimeModel:
    """Service times and the routing policy's knobs (the module docstring; docs/replay.md)."""

    prefill_us_per_token: float = 50.0  # prefill of a prompt token not held
    decode_s: float = 1.0  # after the first token, the request stays in flight this long
    load_bound: float = DEFAULT_LOAD_BOUND  # kv-aware's eps
    load_window: float = DEFAULT_LOAD_WINDOW_S  # kv-aware's recent-load window, seconds
    ssd_cost: float = TierCosts().ssd  # an SSD hit's time, as a fraction of a token's prefill
    # Where the trace has no measured ``done``: commit a request's computed blocks at its
    # modelled end of prefill (True) or at its arrival (False: as if service took no time).
    commit_at_prefill_end: bool = False


@dataclass(frozen=True)
class Scenario:
    """One what-if: tier sizes, pools, routing, admission."""

    l1: Capacity
    ssd: Capacity = Capacity(0, "bytes")
    page_bytes: int = 64 << 20
    instances: int = 1
    pools: str = SHARED  # SHARED | ISOLATED
    route: str = ROUND_ROBIN  # ROUND_ROBIN | KV_AWARE | "field:NAME"
    tinylfu: bool = False
    ssd_writes: str = SSD_WRITES_EVICTIONS  # what L1 hands to the SSD tier (SSD_WRITES)
    quotas: tuple[Quota, ...] = ()  # namespace shares of each pool's L1 (--namespace-quota)
    time: TimeModel = TimeModel()  # the time model and kv-aware's knobs

    @property
    def admission(self) -> str:
        return "tinylfu" if self.tinylfu else "lru"

    @property
    def label(self) -> str:
        pools = f"{self.pools} x{self.instances}" if self.instances > 1 else "1 pool"
        if self.instances > 1 and self.route != ROUND_ROBIN:
            pools += f" {self.route}"
        return f"{pools}, {self.admission}" + (", quotas" if self.quotas else "")

def route_hash(value: str) -> int:
    """A stable, well-mixed 64-bit hash of a routing value (the same on every run and host).

    blake2b, not crc32: crc32 is linear, and its low bits barely change between names like
    ``engine-0`` and ``engine-1``, which then all land on one instance for small N.
    """
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little")


class Cluster:
    """The pools of one scenario and the rule that picks a pool for each request."""

    def __init__(self, scenario: Scenario, unique: int, namespaces: dict[str, int | None],
                 storable: int | None = None) -> None:
        self.scenario = scenario
        page_bytes = {name: size or scenario.page_bytes for name, size in namespaces.items()}
        l1_amount, l1_blocks = scenario.l1.blocks_or_bytes(unique, storable)
        ssd_amount, ssd_blocks = scenario.ssd.blocks_or_bytes(unique, storable)
        n_pools = scenario.instances if scenario.pools == ISOLATED else 1
        l1_split = 1 if scenario.l1.is_unbounded else n_pools
        ssd_split = 1 if scenario.ssd.is_unbounded else n_pools
        self.pools: list[Pool] = [
            Pool(
                (l1_amount // l1_split, l1_blocks),
                (ssd_amount // ssd_split, ssd_blocks),
                page_bytes,
                scenario.tinylfu,
                scenario.ssd_writes,
                Quotas(scenario.quotas) if scenario.quotas else None,
            )
            for _ in range(n_pools)
        ]
        self._field = route_field(scenario.route)
        self.instances = scenario.instances
        # Instance i's pool (shared: all the same one).
        self.pool_of: list[Pool] = (
            self.pools if len(self.pools) == self.instances else [self.pools[0]] * self.instances
        )
        self.kv_aware = scenario.route == KV_AWARE and self.instances > 1
        tm = scenario.time
        self.policy = BoundedLoadKV(tm.load_bound, TierCosts(ssd=tm.ssd_cost))
        self.load = RecentLoad(tm.load_window)
        self._keys = list(range(self.instances))
        self._zeros = [0.0] * self.instances
        self._w_l1 = 1.0 - self.policy.costs.l1
        self._turn = 0

    def instance_for(self, i: int, route: str | None) -> int:
        """round-robin or field:NAME: the instance serving request number ``i`` whose routing
        field value is ``route``."""
        n = self.instances
        if n == 1:
            return 0
        if self._field is None:
            return i % n
        return route_hash(route or "") % n

    def pool_for(self, i: int, route: str | None) -> Pool:
        """The pool serving request number ``i`` (round-robin or field:NAME)."""
        return self.pool_of[self.instance_for(i, route)]

    def saved(self, pool: Pool, namespace: str, hashes: list[bytes], tokens: int, block_tokens: int) -> float:
        """What ``pool`` would save this request, in prefill tokens (peek: nothing touched):
        its L1 prefix, then the SSD tier's continuation, weighted by the tier costs."""
        pos = len(pool.l1.index.prefix(pool.l1.ns[namespace], hashes, touch=False))
        l1 = min(pos * block_tokens, tokens)
        ssd = 0
        if pool.ssd is not None and pos < len(hashes):
            got = len(pool.ssd.index.prefix(pool.ssd.ns[namespace], hashes[pos:], touch=False))
            ssd = min((pos + got) * block_tokens, tokens) - l1
        return self.policy.costs.saved(l1, ssd)

    def choose(self, namespace: str, hashes: list[bytes], tokens: int, block_tokens: int,
               in_flight: Sequence[int], now: float, hinted: bool = True) -> int:
        """kv-aware: the router's decision over the instances, with their loads at ``now``
        (``saved`` per pool, inlined for the pools without an SSD tier: the hot loop).
        ``hinted=False``: the live router had no prefix answer for this request, so the
        decision sees none (the bound and the turn decide), as the router's did."""
        loads = self.load.loads(self._keys, in_flight, now)
        if len(self.pools) == 1 or not hinted:
            saved = self._zeros  # one pool: every instance holds the same
        else:
            saved = []
            w_l1 = self._w_l1
            for p in self.pools:
                if p.ssd is None:
                    got = len(p.l1.index.prefix(p.l1.ns[namespace], hashes, False)) * block_tokens
                    saved.append((got if got < tokens else tokens) * w_l1)
                else:
                    saved.append(self.saved(p, namespace, hashes, tokens, block_tokens))
        i = self.policy.choose(loads, saved)
        self.load.routed(i, now)
        return i

    @property
    def l1_capacity_blocks(self) -> int:
        """L1 blocks over all pools (what the scenario's L1 size holds)."""
        return sum(p.l1.capacity_blocks for p in self.pools)

    def counter(self, name: str, tier: Tier = Tier.L1) -> int:
        """The sum of one BlockIndex counter (``evictions``, ...) of ``tier`` over the pools."""
        if tier not in LOCAL_TIERS:
            raise ValueError(f"a pool has no {tier} tier")
        total = 0
        for p in self.pools:
            t = p.l1 if tier == Tier.L1 else p.ssd
            if t is not None:
                total += getattr(t.index, name)
        return total


def scenario_grid(base: Scenario, pools: Sequence[str], tinylfu: Sequence[bool]) -> list[Scenario]:
    """Every combination of pool modes and admission settings, in the order given."""
    return [replace(base, pools=p, tinylfu=t) for p in pools for t in tinylfu]
