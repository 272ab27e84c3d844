"""The global prefix index in Redis: which node incarnations (nids) hold which blocks.

Layout (``pegaflow/cluster/keys.py``, where the widths are defined once): block ``h`` of a
namespace is field ``keys.field(h)`` of bucket ``keys.bucket_key(tag, h)``; the value lists
the nids holding it, ``keys.NID_BYTES`` each (a holder entry), the top bit of an entry
(``keys.TIER_BIT``) set when that nid holds the block only on its SSD tier. The Lua
scripts below are templates filled with those widths (:func:`_script`).

Contracts:

- :meth:`Index.apply_many` applies a node's updates in order. Applying is idempotent
  and order-insensitive between nids: INSERT adds the nid if absent (or sets its tier
  bit to the update's tier), EVICT removes it if present, whatever its tier. Replaying any suffix of one node's events in order leaves the same state, which
  is what makes re-delivery after a crash safe (see ``pegaflow/meta/events/consumer.py``).
- How: a run of consecutive adds (INSERT, SNAPSHOT) goes as plain ``HSETNX`` commands
  streamed on one connection (``redis_conn.RawPipe``): a new block, the common case, is
  one native command, ~1.5 us of Redis against ~3.3 us for the same step inside a Lua
  script (measured with bench/meta.py's workload; 2x the apply rate, half the Redis
  CPU). Blocks whose ``HSETNX`` found the field (another nid holds it, or a replay)
  then go through the ``_APPLY`` script, which merges; that happens before any later
  update of the run's node is sent, so an EVICT never overtakes the add it follows.
  EVICTs always run ``_APPLY`` (a read-modify-write). Without a real socket (fakeredis)
  every update runs ``_APPLY``.
- :meth:`Index.query` returns, for every nid holding block 0, the number of leading
  blocks it holds, in one round trip (:meth:`Index.query_tiers`: and how many of them it
  holds only on SSD). It knows nothing of liveness: callers filter by the
  visible nids (``registry.py``). How: one plain ``HGET`` per block, packed by numpy and
  sent as one batch, the replies read by hiredis in C (``redis_conn.raw_round_trip``),
  then :func:`prefix_tiers`. Measured on 128-block queries at 1M indexed blocks: 314-381
  against 461-477 us p50 for a Lua script, whose ``redis.call`` per block costs ~2.6 us
  inside Redis against ~0.4 us for a plain ``HGET``. Without a real socket (fakeredis)
  the ``_QUERY`` script reads the holder lists up to the first missing block and the same
  :func:`prefix_tiers` runs on them; tests hold the two equal.
- Python loops over blocks only where holders change along the prefix (a second nid
  holds part of it); the common run of one unchanged holder list is compared in C.
"""

from __future__ import annotations

import math
import string
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from redis.typing import EncodableT

from pegaflow.cluster import keys, notices
from pegaflow.cluster.redis_conn import (
    Call,
    Client,
    RawPipe,
    Reply,
    Script,
    checked,
    raw_round_trip,
    run_scripts,
)
from pegaflow.core.identity import HASH_BYTES
from pegaflow.core.tiers import Tier
from pegaflow.meta.events.schema import Op, Update
from pegaflow.policy.classes import MIN_OWNER_THRESHOLD

Pause = Callable[[float], object]  # called with the seconds a step of a background scan took


def _no_pause(busy_s: float) -> None:
    pass


DUMP_CHUNK = 1024  # buckets per HGETALL pipeline when dumping / sweeping
SWEEP_CHUNK = 256  # buckets per sweep script call: bounds the time one call holds Redis
CENSUS_CHUNK = 64  # buckets per census script call (~0.35 ms of Redis at 1M blocks, 2-core host L)
CENSUS_GROUP = 4  # census calls per round trip: Redis serves no one else for the group (16: ~6 ms)
CENSUS_SCAN = 256  # SCAN's COUNT in a census (1024: ~2 ms of Redis a call at 1M blocks, host L)
# Block updates per pipeline of _APPLY calls: Redis runs a script to its end before it
# serves anyone else, and a pipeline of a whole consumer step (~130k updates, ~0.4 s of
# scripts) put every QueryPrefix behind it. Plain HSETNX batches need no such bound:
# Redis reads a client's pipeline 16 KiB at a time and serves others in between.
APPLY_ROUND_BLOCKS = 512
OWNERS_REFRESH_S = 1.0  # how long the owner-count settings read from Redis are used (pegaflow/meta/owners.py)


def _script(template: str) -> Script:
    """A Lua script of the index with the layout's widths (``keys.py``) filled in:
    ``$HASH`` (bytes of a block hash), ``$BUCKET`` (its leading bytes naming the bucket),
    ``$NID`` (bytes of one holder), ``$TOP`` (the tier bit's value in the entry's first byte),
    ``$MIN`` (the lowest owner-count threshold), ``$OWNERS`` (:data:`_OWNERS`: the owner-count
    rule, with the notice format's constants)."""
    top = keys.TIER_BIT >> (8 * (keys.NID_BYTES - 1))
    widths = {"HASH": HASH_BYTES, "BUCKET": keys.BUCKET_BYTES, "NID": keys.NID_BYTES, "TOP": top,
              "MIN": MIN_OWNER_THRESHOLD}
    owners = string.Template(_OWNERS).substitute(
        widths, DEMOTE=notices.DEMOTE.decode(), RESTORE=notices.RESTORE.decode(), MAX=notices.MAX_ENTRIES,
        TTL=notices.TTL_MS)
    return Script(string.Template(template).substitute(widths, OWNERS=owners))


# The owner-count rule of pegaflow/policy/classes.py (class_notices), for the scripts that
# change holder lists: ``owners(T, uncounted)`` sets the threshold (< $MIN: no notices) and
# the nids that count as no owner; ``rule(h, n0, after, joined)`` queues notices for block
# ``h`` (16 bytes) given the count before, the counted holder ids after (a list) and those of
# them that joined (a list); ``flush(prefix)`` appends each holder's notices to its list.
# A holder id is its entry without the tier bit.
_OWNERS = """
local T = 0
local skip = {}
local dem, res = {}, {}
local function id(c) return string.char(string.byte(c, 1) % $TOP) .. string.sub(c, 2) end
-- big-endian bytes of a number and back (not every Lua Redis runs has the struct library)
local function bucket(b)
  local out = {}
  for i = $BUCKET, 1, -1 do out[i] = string.char(b % 256) b = math.floor(b / 256) end
  return table.concat(out)
end
local function number(c)
  local n = 0
  for i = 1, #c do n = n * 256 + string.byte(c, i) end
  return n
end
local function owners(t, uncounted)
  T = tonumber(t) or 0
  for j = 1, #uncounted, $NID do skip[string.sub(uncounted, j, j + $NID - 1)] = true end
end
local function counted(v, ignore)
  local out = {}
  for j = 1, #v, $NID do
    local c = id(string.sub(v, j, j + $NID - 1))
    if not ignore[c] then out[#out + 1] = c end
  end
  return out
end
local function put(t, who, h)
  local l = t[who]
  if not l then l = {} t[who] = l end
  l[#l + 1] = h
end
local function rule(h, n0, after, joined)
  local n1 = #after
  if n1 >= T then
    if n0 < T then
      for _, c in ipairs(after) do put(dem, c, h) end
    else
      for _, c in ipairs(joined) do put(dem, c, h) end
    end
  elseif n0 >= T or (n1 == 1 and n0 > 1) then
    for _, c in ipairs(after) do put(res, c, h) end
  end
end
local function flush(prefix)
  local out = {}
  for who, l in pairs(dem) do
    local k = out[who] or {}
    k[#k + 1] = '$DEMOTE' .. table.concat(l)
    out[who] = k
  end
  for who, l in pairs(res) do
    local k = out[who] or {}
    k[#k + 1] = '$RESTORE' .. table.concat(l)
    out[who] = k
  end
  for who, elements in pairs(out) do
    local key = prefix .. string.format('%d', number(who))
    redis.call('RPUSH', key, unpack(elements))
    redis.call('LTRIM', key, -$MAX, -1)
    redis.call('PEXPIRE', key, $TTL)
  end
end
"""


_APPLY = _script(
    """
$OWNERS
local pre = ARGV[1]
local add = ARGV[2] == '1'
local nid = ARGV[3]  -- the holder entry: nid, tier bit set for SSD
local blob = ARGV[4]
owners(ARGV[5], ARGV[6])  -- the owner-count threshold and the uncounted nids; ARGV[7]: notice prefix
local notify = T >= $MIN
local me = id(nid)
local joins = {}
if not skip[me] then joins = {me} end
local changed = 0
local b1 = string.byte(nid, 1) % $TOP
local rest = string.sub(nid, 2)
-- entry c is this nid's, whatever its tier bit
local function same(c) return string.sub(c, 2) == rest and string.byte(c, 1) % $TOP == b1 end
for off = 1, #blob, $HASH do
  local k = pre .. string.sub(blob, off, off + $BUCKET - 1)
  local f = string.sub(blob, off + $BUCKET, off + $HASH - 1)
  if add then
    -- A new block (the common case) costs one call (one holder: below any threshold).
    if redis.call('HSETNX', k, f, nid) == 1 then
      changed = changed + 1
    else
      local v = redis.call('HGET', k, f)
      local at = nil
      for j = 1, #v, $NID do
        if same(string.sub(v, j, j + $NID - 1)) then at = j break end
      end
      if not at then
        redis.call('HSET', k, f, v .. nid)
        changed = changed + 1
        if notify then
          rule(string.sub(blob, off, off + $HASH - 1), #counted(v, skip), counted(v .. nid, skip), joins)
        end
      elseif string.sub(v, at, at + $NID - 1) ~= nid then  -- a tier change
        local v2 = string.sub(v, 1, at - 1) .. nid .. string.sub(v, at + $NID)
        redis.call('HSET', k, f, v2)
        changed = changed + 1
        if notify and nid == me then  -- from its SSD back into DRAM: it joins the owners in DRAM
          local after = counted(v2, skip)
          rule(string.sub(blob, off, off + $HASH - 1), #after, after, joins)
        end
      end
    end
  else
    local v = redis.call('HGET', k, f)
    if v then
    local keep = {}
    local found = false
    for j = 1, #v, $NID do
      local c = string.sub(v, j, j + $NID - 1)
      if same(c) then found = true else keep[#keep + 1] = c end
    end
    if found then
      changed = changed + 1
      if #keep == 0 then redis.call('HDEL', k, f) else redis.call('HSET', k, f, table.concat(keep)) end
      if notify then
        rule(string.sub(blob, off, off + $HASH - 1), #counted(v, skip), counted(table.concat(keep), skip), {})
      end
    end
    end
  end
end
if notify then flush(ARGV[7]) end
return changed
"""
)

# The holder lists of the leading blocks, up to the first block nobody holds; the prefix
# per holder is computed from them by prefix_tiers, as for the HGET batch.
_QUERY = _script(
    """
local pre = ARGV[1]
local blob = ARGV[2]
local out = {}
for off = 1, #blob, $HASH do
  local v = redis.call('HGET', pre .. string.sub(blob, off, off + $BUCKET - 1), string.sub(blob, off + $BUCKET, off + $HASH - 1))
  if not v then break end
  out[#out + 1] = v
end
return out
"""
)

_SWEEP = _script(
    """
$OWNERS
local pre = ARGV[1]
local first = tonumber(ARGV[2])
local last = tonumber(ARGV[3])
local dead = {}
for j = 1, #ARGV[4], $NID do dead[string.sub(ARGV[4], j, j + $NID - 1)] = true end
owners(ARGV[5], ARGV[6])  -- ARGV[7]: notice prefix
local notify = T >= $MIN
local removed = 0
for b = first, last do
  local s = bucket(b)
  local k = pre .. s
  local all = redis.call('HGETALL', k)
  for i = 1, #all, 2 do
    local v = all[i + 1]
    local keep = {}
    for j = 1, #v, $NID do
      local c = string.sub(v, j, j + $NID - 1)
      if dead[id(c)] then removed = removed + 1 else keep[#keep + 1] = c end
    end
    if #keep * $NID ~= #v then
      if #keep == 0 then redis.call('HDEL', k, all[i]) else redis.call('HSET', k, all[i], table.concat(keep)) end
      if notify then rule(s .. all[i], #counted(v, skip), counted(table.concat(keep), skip), {}) end
    end
  end
end
if notify then flush(ARGV[7]) end
return removed
"""
)

# The owner counts of every block some of whose holders changed between counting and not
# (nodes that died, came back, or were retired: pegaflow/meta/owners.py): ARGV[4] the
# uncounted nids before, ARGV[5] after. Holders that count again are the ones that joined.
_RECOUNT = _script(
    """
$OWNERS
local pre = ARGV[1]
local first = tonumber(ARGV[2])
local last = tonumber(ARGV[3])
local before = {}
for j = 1, #ARGV[4], $NID do before[string.sub(ARGV[4], j, j + $NID - 1)] = true end
owners(ARGV[6], ARGV[5])  -- ARGV[7]: notice prefix
local moved = {}
for c in pairs(before) do if not skip[c] then moved[c] = true end end
for c in pairs(skip) do if not before[c] then moved[c] = true end end
local fields = 0
if T >= $MIN and next(moved) then
  for b = first, last do
    local s = bucket(b)
    local all = redis.call('HGETALL', pre .. s)
    for i = 1, #all, 2 do
      local v = all[i + 1]
      local touched = false
      for j = 1, #v, $NID do
        if moved[id(string.sub(v, j, j + $NID - 1))] then touched = true break end
      end
      if touched then
        fields = fields + 1
        local after = counted(v, skip)
        local joined = {}
        for _, c in ipairs(after) do if before[c] then joined[#joined + 1] = c end end
        rule(s .. all[i], #counted(v, before), after, joined)
      end
    end
  end
  flush(ARGV[7])
end
return fields
"""
)

# The census of some buckets (KEYS, one namespace's: one slot): ARGV[1] the live nids. Returns
# block keys, holder entries, keys with 1, 2, 3, >= 4 live holders, live holder entries. In
# Redis, not in the metaserver: a count in Python held the interpreter lock of the gRPC handlers
# for seconds (at 8M blocks, lookups while it ran had a p99 of 12-15 ms against 0.7 ms without).
_CENSUS = _script(
    """
$OWNERS
local live = {}
for j = 1, #ARGV[1], $NID do live[string.sub(ARGV[1], j, j + $NID - 1)] = true end
local entries, owners, copies = 0, 0, 0
local red = {0, 0, 0, 0}
for k = 1, #KEYS do
  local vals = redis.call('HVALS', KEYS[k])
  entries = entries + #vals
  for i = 1, #vals do
    local v = vals[i]
    local n = 0
    for j = 1, #v, $NID do
      owners = owners + 1
      if live[id(string.sub(v, j, j + $NID - 1))] then n = n + 1 end
    end
    if n > 0 then
      copies = copies + n
      if n > 4 then n = 4 end
      red[n] = red[n] + 1
    end
  end
end
return {entries, owners, red[1], red[2], red[3], red[4], copies}
"""
)

_SWAP = _script(
    """
local removed = 0
for b = tonumber(ARGV[3]), tonumber(ARGV[4]) do
  local s = struct.pack('>I$BUCKET', b)
  local src = ARGV[2] .. s
  local dst = ARGV[1] .. s
  if redis.call('EXISTS', src) == 1 then
    redis.call('RENAME', src, dst)
  else
    removed = removed + redis.call('DEL', dst)
  end
end
return removed
"""
)


def nid_bytes(nid: int, tier: Tier = Tier.L1) -> bytes:
    """The holder entry of ``nid`` holding a block in ``tier``."""
    if not 0 <= nid < keys.TIER_BIT:
        raise ValueError(f"nid {nid} out of range")
    return (nid | keys.TIER_BIT if tier == Tier.SSD else nid).to_bytes(keys.NID_BYTES, "big")


@dataclass(frozen=True, slots=True)
class Held:
    """What one holder has of a queried prefix: ``prefix_len`` leading blocks, of which
    ``ssd_blocks`` only on its SSD tier (the rest in DRAM)."""

    prefix_len: int
    ssd_blocks: int = 0

    @property
    def tier(self) -> Tier:
        """The slowest tier the holder would read the prefix from."""
        return Tier.SSD if self.ssd_blocks else Tier.L1


def _field_commands(command: bytes, prefix: bytes, blob: bytes, value: bytes | None = None) -> bytes:
    """RESP of ``<command> <bucket> <field> [<value>]`` for each 16-byte hash of ``blob``:
    one row per command, its constant parts broadcast and the hash's two slices copied in
    by numpy (redis-py's packer costs ~2 us a command, a Python loop of joins ~0.8 us; see
    RawPipe)."""
    argc = 3 if value is None else 4
    bucket = keys.BUCKET_BYTES
    head = np.frombuffer(b"*%d\r\n$%d\r\n%s\r\n$%d\r\n%s" % (argc, len(command), command, len(prefix) + bucket, prefix),
                         np.uint8)
    mid = np.frombuffer(b"\r\n$%d\r\n" % keys.FIELD_BYTES, np.uint8)
    tail = np.frombuffer(b"\r\n" if value is None else b"\r\n$%d\r\n%s\r\n" % (len(value), value), np.uint8)
    h = np.frombuffer(blob, np.uint8).reshape(-1, HASH_BYTES)
    a = len(head)
    b = a + bucket + len(mid)
    out = np.empty((len(h), b + keys.FIELD_BYTES + len(tail)), np.uint8)
    out[:, :a] = head
    out[:, a : a + bucket] = h[:, :bucket]
    out[:, a + bucket : b] = mid
    out[:, b : b + keys.FIELD_BYTES] = h[:, bucket:]
    out[:, b + keys.FIELD_BYTES :] = tail
    return out.tobytes()


def _hsetnx_batch(prefix: bytes, blob: bytes, nid: bytes) -> bytes:
    """``HSETNX <bucket> <field> <nid>`` for each hash of ``blob`` (index updates)."""
    return _field_commands(b"HSETNX", prefix, blob, nid)


def _hget_batch(prefix: bytes, blob: bytes) -> bytes:
    """``HGET <bucket> <field>`` for each hash of ``blob`` (prefix queries)."""
    return _field_commands(b"HGET", prefix, blob)


def prefix_holders(values: Sequence[bytes | None]) -> dict[int, int]:
    """nid -> number of leading blocks it holds, from each block's holder list (``None``:
    no holder), for the nids holding block 0 (any tier)."""
    return {nid: h.prefix_len for nid, h in prefix_tiers(values).items()}


def _entries(v: bytes) -> dict[int, bool]:
    """nid -> held only on SSD, of one holder list."""
    n, top = keys.NID_BYTES, keys.TIER_BIT
    out = {}
    for j in range(0, len(v), n):
        e = int.from_bytes(v[j : j + n], "big")
        out[e & ~top] = bool(e & top)
    return out


def prefix_tiers(values: Sequence[bytes | None]) -> dict[int, Held]:
    """nid -> :class:`Held` (leading blocks it holds, how many of them only on SSD), from
    each block's holder list (``None``: no holder), for the nids holding block 0."""
    n = len(values)
    cut = n
    if None in values:  # list.index and count run in C
        cut = values.index(None)
    if cut == 0:
        return {}
    first = values[0]
    assert first is not None
    if values[:cut].count(first) == cut:  # one unchanged list (the common case)
        return {nid: Held(cut, cut if ssd else 0) for nid, ssd in _entries(first).items()}
    # Per candidate: the tier of its current run of blocks, where that run began, and the
    # SSD blocks of its finished runs. Python work only where a holder list changes.
    tier = _entries(first)
    since = dict.fromkeys(tier, 0)
    ssd = dict.fromkeys(tier, 0)
    out: dict[int, Held] = {}
    prev = first
    for i in range(1, cut):
        v = values[i]
        if v == prev:
            continue
        assert v is not None
        prev = v
        now = _entries(v)
        for c in list(tier):
            t = now.get(c)
            if t is not None and t == tier[c]:
                continue
            if tier[c]:
                ssd[c] += i - since[c]
            if t is None:
                out[c] = Held(i, ssd[c])
                del tier[c]
            else:
                tier[c], since[c] = t, i
        if not tier:
            return out
    for c, t in tier.items():
        out[c] = Held(cut, ssd[c] + (cut - since[c] if t else 0))
    return out


def _not_set(blob: bytes, replies: list[Reply]) -> bytes:
    """The hashes of ``blob`` whose HSETNX reply is not 1 (the field existed, or an error)."""
    try:
        miss = np.flatnonzero(np.array(replies, dtype=np.int64) != 1)
    except (TypeError, ValueError):  # an error reply among them
        miss = np.array([k for k, v in enumerate(replies) if v != 1], dtype=np.int64)
    return np.frombuffer(blob, np.uint8).reshape(-1, HASH_BYTES)[miss].tobytes()


def _nids(v: bytes) -> list[int]:
    """The nids of a holder list, whatever their tier."""
    n, mask = keys.NID_BYTES, keys.TIER_BIT - 1
    return [int.from_bytes(v[j : j + n], "big") & mask for j in range(0, len(v), n)]


@dataclass(frozen=True)
class Census:
    """The index counted whole (:meth:`Index.census`): a background sample, never a scrape's."""

    entries: int  # block keys (bucket fields) of every namespace
    owners: int  # holder entries over all of them (every incarnation still listed)
    redundancy: tuple[int, int, int, int]  # keys with 1, 2, 3, >= 4 live holders
    copies: int  # live holders over the keys with at least one

    @property
    def redundancy_avg(self) -> float:
        keys_ = sum(self.redundancy)
        return self.copies / keys_ if keys_ else 0.0


class Index:
    """Reads and writes the index of every namespace under one key prefix (live or rebuild).

    Writes to the live index (``keys.BUCKET_PREFIX``) also send the class notices of the
    owner counts they move (pegaflow/policy/classes.py; docs/architecture.md, "Replacement
    classes"), with the threshold and the uncounted nids the metaserver keeps in Redis
    (pegaflow/meta/owners.py), read again every ``OWNERS_REFRESH_S``; a rebuild's scratch
    index sends none.
    """

    def __init__(self, r: Client, prefix: str = keys.BUCKET_PREFIX, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.r = r
        self.prefix = prefix
        self._native: bool | None = None  # RawPipe.supported(r), asked once
        self._clock = clock
        self._owners: tuple[int, bytes] = (0, b"")  # (threshold, uncounted nids packed), read at _owners_at
        self._owners_at = -math.inf

    def owner_args(self) -> tuple[int, bytes]:
        """(owner-count threshold, the uncounted nids as holder ids) for the scripts' notices;
        (0, b"") off the live index or while no metaserver published a threshold."""
        if self.prefix != keys.BUCKET_PREFIX:
            return 0, b""
        now = self._clock()
        if now - self._owners_at >= OWNERS_REFRESH_S:
            p = self.r.pipeline(transaction=False)
            p.get(keys.OWNER_COUNT)
            p.smembers(keys.UNCOUNTED)
            t, uncounted = p.execute()
            threshold = int(t) if t else 0
            self._owners = (threshold if threshold >= MIN_OWNER_THRESHOLD else 0,
                            b"".join(nid_bytes(int(n)) for n in sorted(int(x) for x in uncounted)))
            self._owners_at = now
        return self._owners

    def apply_call(self, op: Op, namespace: str, nid: int, blob: bytes, tier: Tier = Tier.L1) -> Call:
        """The script call applying one INSERT/SNAPSHOT/EVICT batch (``blob`` = 16-byte hashes;
        ``tier``: where an add says the nid holds them)."""
        tag = keys.ns_tag(namespace)
        add = "0" if op == Op.EVICT else "1"
        threshold, uncounted = self.owner_args()
        return (
            _APPLY,
            [keys.anchor_key(tag)],
            [keys.bucket_prefix(tag, self.prefix), add, nid_bytes(nid, tier if op != Op.EVICT else Tier.L1), blob,
             threshold, uncounted, keys.notice_prefix(tag)],
        )

    def apply(self, op: Op, namespace: str, nid: int, hashes: Sequence[bytes] | bytes, tier: Tier = Tier.L1) -> int:
        """Apply one batch now; returns how many (block, nid) pairs changed (or changed tier)."""
        blob = hashes if isinstance(hashes, bytes) else b"".join(hashes)
        return self.apply_many([Update(op, namespace, nid, blob, tier)])

    def apply_many(self, updates: Sequence[Update], native: bool | None = None) -> int:
        """Apply ``updates`` in order (the module's contracts); returns how many (block, nid)
        pairs changed. Redis errors are raised. ``native=False`` runs every update through
        ``_APPLY`` (the reference the tests hold the native path equal to)."""
        if native is None:
            native = self._native
            if native is None:
                native = self._native = RawPipe.supported(self.r)
        changed = 0
        i = 0
        while i < len(updates):
            j = i + 1
            while j < len(updates) and updates[j].adds == updates[i].adds:
                j += 1
            run = updates[i:j]
            changed += self._add_native(run) if native and run[0].adds else self._run_scripts(run)
            i = j
        return changed

    def _run_scripts(self, updates: Sequence[Update]) -> int:
        """``_APPLY`` per update, pipelined in rounds of APPLY_ROUND_BLOCKS updates."""
        changed = 0
        calls: list[Call] = []
        n = 0
        for k, u in enumerate(updates):
            calls.append(self.apply_call(u.op, u.namespace, u.nid, u.blob, u.tier))
            n += len(u.blob) // HASH_BYTES
            if n >= APPLY_ROUND_BLOCKS or k == len(updates) - 1:
                for res in run_scripts(self.r, calls):
                    if isinstance(res, Exception):
                        raise res
                    changed += int(res)
                calls, n = [], 0
        return changed

    def _add_native(self, updates: Sequence[Update]) -> int:
        """A run of adds as HSETNX batches, one RawPipe per shard; the blocks whose field
        existed (or that got an error reply: a moved slot, say) are then merged by _APPLY."""
        changed = 0
        merge: list[Update] = []
        pipes: dict[bytes, RawPipe[Update]] = {}

        def settle(done: list[tuple[Update, list[Reply]]]) -> None:
            nonlocal changed
            for u, replies in done:
                if replies.count(1) == len(replies):
                    changed += len(replies)
                    continue
                rest = _not_set(u.blob, replies)
                changed += len(replies) - len(rest) // HASH_BYTES
                merge.append(Update(u.op, u.namespace, u.nid, rest, u.tier))

        try:
            for u in updates:
                if not u.blob:
                    continue
                tag = keys.ns_tag(u.namespace)
                prefix = keys.bucket_prefix(tag, self.prefix)
                pipe = pipes.get(prefix)
                if pipe is None:
                    pipe = pipes[prefix] = RawPipe(self.r, keys.anchor_key(tag))
                settle(pipe.send(u, _hsetnx_batch(prefix, u.blob, nid_bytes(u.nid, u.tier)), len(u.blob) // HASH_BYTES))
            for pipe in pipes.values():
                settle(pipe.drain())
        finally:
            for pipe in pipes.values():
                pipe.close()
        return changed + (self._run_scripts(merge) if merge else 0)

    def query_command(self, namespace: str, hashes: Sequence[bytes]) -> tuple[str, list[EncodableT]]:
        """(routing key, EVALSHA args) of a prefix query, for batching with other commands."""
        tag = keys.ns_tag(namespace)
        anchor = keys.anchor_key(tag)
        return anchor, [
            "EVALSHA",
            _QUERY.sha,
            1,
            anchor,
            keys.bucket_prefix(tag, self.prefix),
            b"".join(hashes),
        ]

    @staticmethod
    def decode_query(reply: Sequence[Reply]) -> dict[int, int]:
        return prefix_holders(list(reply))

    @staticmethod
    def decode_query_tiers(reply: Sequence[Reply]) -> dict[int, Held]:
        return prefix_tiers(list(reply))

    def query_batch(self, namespace: str, hashes: Sequence[bytes]) -> tuple[str, bytes, int]:
        """(routing key, packed ``HGET`` per block, number of commands) of a prefix query,
        for ``redis_conn.raw_round_trip``; its replies go to :func:`prefix_holders`."""
        tag = keys.ns_tag(namespace)
        return keys.anchor_key(tag), _hget_batch(keys.bucket_prefix(tag, self.prefix), b"".join(hashes)), len(hashes)

    def query(self, namespace: str, hashes: Sequence[bytes], script: bool | None = None) -> dict[int, int]:
        """nid -> number of leading blocks of ``hashes`` it holds (only nids holding block 0).
        ``script``: force the ``_QUERY`` script (True) or the HGET batch (False)."""
        return {nid: h.prefix_len for nid, h in self.query_tiers(namespace, hashes, script).items()}

    def query_tiers(self, namespace: str, hashes: Sequence[bytes], script: bool | None = None) -> dict[int, Held]:
        """nid -> :class:`Held` of ``hashes`` (only nids holding block 0); ``script`` as in :meth:`query`."""
        if not hashes:
            return {}
        if not script:
            got = raw_round_trip(self.r, [self.query_batch(namespace, hashes)])
            if got is not None:
                return prefix_tiers(checked(got[0]))
            if script is False:
                raise TypeError("the HGET batch needs a client on a real socket")
        anchor, cmd = self.query_command(namespace, hashes)
        return self.decode_query_tiers(_QUERY(self.r, [anchor], cmd[4:]))

    def ensure_scripts(self) -> None:
        """Load every script on every shard (a query batch cannot load scripts on its own)."""
        for s in (_APPLY, _QUERY, _SWEEP, _SWAP, _RECOUNT):
            self.r.script_load(s.source)

    def holders(self, namespace: str, hashes: Sequence[bytes]) -> list[frozenset[int]]:
        """The nids holding each block (one pipelined HGET per block; for tests and tools)."""
        tag = keys.ns_tag(namespace)
        p = self.r.pipeline(transaction=False)
        for h in hashes:
            p.hget(keys.bucket_key(tag, h, self.prefix), keys.field(h))
        return [frozenset(_nids(v)) if v else frozenset() for v in p.execute()]

    def holder_tiers(self, namespace: str, hashes: Sequence[bytes]) -> list[dict[int, Tier]]:
        """nid -> tier, per block (one pipelined HGET per block; for tests and tools)."""
        tag = keys.ns_tag(namespace)
        p = self.r.pipeline(transaction=False)
        for h in hashes:
            p.hget(keys.bucket_key(tag, h, self.prefix), keys.field(h))
        return [{n: Tier.SSD if s else Tier.L1 for n, s in _entries(v).items()} if v else {} for v in p.execute()]

    # --- whole-index operations (rebuild, sweep, tests) -----------------------------------

    def _bucket_chunks(self, tag: str, chunk: int) -> Iterator[tuple[int, int]]:
        for first in range(0, keys.BUCKETS, chunk):
            yield first, min(first + chunk, keys.BUCKETS) - 1

    def sweep(self, tags: Iterable[str], dead_nids: Iterable[int]) -> int:
        """Remove every entry of ``dead_nids``; returns the number of (block, nid) pairs removed."""
        blob = b"".join(nid_bytes(n) for n in sorted(set(dead_nids)))
        if not blob:
            return 0
        removed = 0
        threshold, uncounted = self.owner_args()
        for tag in tags:
            anchor = keys.anchor_key(tag)
            pre = keys.bucket_prefix(tag, self.prefix)
            calls: list[Call] = [
                (_SWEEP, [anchor], [pre, first, last, blob, threshold, uncounted, keys.notice_prefix(tag)])
                for first, last in self._bucket_chunks(tag, SWEEP_CHUNK)
            ]
            for i in range(0, len(calls), 16):
                removed += sum(run_scripts(self.r, calls[i : i + 16]))
        return removed

    def recount(self, tags: Iterable[str], before: Iterable[int], after: Iterable[int], threshold: int) -> int:
        """Send the class notices of the owner counts that change when the uncounted nids go
        from ``before`` to ``after`` (pegaflow/meta/owners.py); returns the blocks looked at."""
        if self.prefix != keys.BUCKET_PREFIX or threshold < MIN_OWNER_THRESHOLD:
            return 0
        old = b"".join(nid_bytes(n) for n in sorted(set(before)))
        new = b"".join(nid_bytes(n) for n in sorted(set(after)))
        if old == new:
            return 0
        fields = 0
        for tag in tags:
            anchor = keys.anchor_key(tag)
            pre = keys.bucket_prefix(tag, self.prefix)
            calls: list[Call] = [
                (_RECOUNT, [anchor], [pre, first, last, old, new, threshold, keys.notice_prefix(tag)])
                for first, last in self._bucket_chunks(tag, SWEEP_CHUNK)
            ]
            for i in range(0, len(calls), 16):
                for res in run_scripts(self.r, calls[i : i + 16]):
                    if isinstance(res, Exception):
                        raise res
                    fields += int(res)
        return fields

    def _existing(self, tag: str, pause: Pause = _no_pause, count: int = DUMP_CHUNK) -> list[bytes]:
        """Bucket keys of a namespace that exist (SCAN ``count`` at a time: sparse namespaces
        cost little); ``pause`` as :meth:`census`'s, after every ``count`` keys."""
        pat = keys.bucket_prefix(tag, self.prefix) + b"*"
        found: set[bytes] = set()
        n, t0 = 0, time.monotonic()
        for k in self.r.scan_iter(match=pat, count=count):  # SCAN may repeat a key: the set
            found.add(k)
            n += 1
            if n % count == 0:
                pause(time.monotonic() - t0)
                t0 = time.monotonic()
        return sorted(found)

    def dump(
        self, tags: Iterable[str], visible: set[int] | None = None
    ) -> dict[tuple[str, bytes], frozenset[int]]:
        """{(tag, hash): nids} for every block (nids filtered by ``visible`` when given)."""
        out: dict[tuple[str, bytes], frozenset[int]] = {}
        for tag in tags:
            plen = len(keys.bucket_prefix(tag, self.prefix))
            existing = self._existing(tag)
            for i in range(0, len(existing), DUMP_CHUNK):
                chunk = existing[i : i + DUMP_CHUNK]
                p = self.r.pipeline(transaction=False)
                for k in chunk:
                    p.hgetall(k)
                for k, fields in zip(chunk, p.execute(), strict=True):
                    b = k[plen:]
                    for f, v in fields.items():
                        nids = frozenset(n for n in _nids(v) if visible is None or n in visible)
                        if nids:
                            out[(tag, b + f)] = nids
        return out

    def census(self, tags: Iterable[str], live: set[int], pause: Pause = _no_pause) -> Census:
        """Count every block key, its holders, and how many are ``live`` (visible nids): SCAN
        the buckets, count them in Redis (:data:`_CENSUS`, ``CENSUS_CHUNK`` buckets a call,
        ``CENSUS_GROUP`` calls a round trip). O(index) in Redis, a few numbers a call here: for
        a background thread, which ``pause`` paces: it is called after every round trip with
        the seconds it took (the daemon waits a multiple of them, ``run_census``)."""
        blob = b"".join(nid_bytes(n) for n in sorted(live))
        total = [0] * 7
        for tag in tags:
            existing = self._existing(tag, pause, CENSUS_SCAN)
            calls: list[Call] = [(_CENSUS, existing[i : i + CENSUS_CHUNK], [blob])
                                 for i in range(0, len(existing), CENSUS_CHUNK)]
            for i in range(0, len(calls), CENSUS_GROUP):
                t0 = time.monotonic()
                replies = run_scripts(self.r, calls[i : i + CENSUS_GROUP])
                pause(time.monotonic() - t0)
                for counts in replies:
                    if isinstance(counts, Exception):
                        raise counts
                    total = [a + int(b) for a, b in zip(total, counts, strict=True)]
        entries, owners, r1, r2, r3, r4, copies = total
        return Census(entries, owners, (r1, r2, r3, r4), copies)

    def clear(self, tags: Iterable[str]) -> None:
        """Delete every bucket of these namespaces under this prefix."""
        for tag in tags:
            existing = self._existing(tag)
            for i in range(0, len(existing), DUMP_CHUNK):
                p = self.r.pipeline(transaction=False)
                for k in existing[i : i + DUMP_CHUNK]:
                    p.delete(k)
                p.execute()

    def swap_into(self, live: Index, tags: Iterable[str]) -> None:
        """Move this index's buckets over ``live``'s, bucket by bucket (each bucket atomically)."""
        for tag in tags:
            anchor = keys.anchor_key(tag)
            dst = keys.bucket_prefix(tag, live.prefix)
            src = keys.bucket_prefix(tag, self.prefix)
            calls: list[Call] = [
                (_SWAP, [anchor], [dst, src, first, last])
                for first, last in self._bucket_chunks(tag, SWEEP_CHUNK)
            ]
            run_scripts(self.r, calls)
