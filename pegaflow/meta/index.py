"""The global prefix index in Redis: which node incarnations (nids) hold which blocks.

Layout (see ``keys.py``): block ``h`` of a namespace is field ``h[2:]`` of bucket
``pf:b:{tag}`` + ``h[:2]``; the value lists the nids holding it, 4 bytes each.

Contracts:

- :meth:`Index.apply_calls` builds one Lua call per event batch. Applying is idempotent
  and order-insensitive between nids: INSERT adds the nid if absent, EVICT removes it if
  present. Replaying any suffix of one node's events in order leaves the same state, which
  is what makes re-delivery after a crash safe (see ``pegaflow/meta/ingest.py``).
- :meth:`Index.query` returns, for every nid holding block 0, the number of leading
  blocks it holds, computed inside Redis by one script (one round trip). It knows
  nothing of liveness: callers filter by the visible nids (``registry.py``).
- Python never loops over blocks: hashes go to Redis as one blob, Lua slices it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pegaflow.cluster import keys
from pegaflow.cluster.redis_conn import Call, Client, Script, run_scripts
from pegaflow.cluster.schema import Op

DUMP_CHUNK = 1024  # buckets per HGETALL pipeline when dumping / sweeping
SWEEP_CHUNK = 256  # buckets per sweep script call: bounds the time one call holds Redis

_APPLY = Script(
    """
local pre = ARGV[1]
local add = ARGV[2] == '1'
local nid = ARGV[3]
local blob = ARGV[4]
local changed = 0
for off = 1, #blob, 16 do
  local k = pre .. string.sub(blob, off, off + 1)
  local f = string.sub(blob, off + 2, off + 15)
  if add then
    -- A new block (the common case) costs one call.
    if redis.call('HSETNX', k, f, nid) == 1 then
      changed = changed + 1
    else
      local v = redis.call('HGET', k, f)
      local found = false
      for j = 1, #v, 4 do
        if string.sub(v, j, j + 3) == nid then found = true break end
      end
      if not found then
        redis.call('HSET', k, f, v .. nid)
        changed = changed + 1
      end
    end
  else
    local v = redis.call('HGET', k, f)
    if v then
    local keep = {}
    local found = false
    for j = 1, #v, 4 do
      local c = string.sub(v, j, j + 3)
      if c == nid then found = true else keep[#keep + 1] = c end
    end
    if found then
      changed = changed + 1
      if #keep == 0 then redis.call('HDEL', k, f) else redis.call('HSET', k, f, table.concat(keep)) end
    end
    end
  end
end
return changed
"""
)

_QUERY = Script(
    """
local pre = ARGV[1]
local blob = ARGV[2]
local cand = nil
local out = {}
local n = 0
-- nid c (4 bytes) is in v (4-byte aligned list); a plain find could match across two nids.
local function holds(v, c)
  local i = 1
  while true do
    local p = string.find(v, c, i, true)
    if not p then return false end
    if (p - 1) % 4 == 0 then return true end
    i = p + 1
  end
end
for off = 1, #blob, 16 do
  local v = redis.call('HGET', pre .. string.sub(blob, off, off + 1), string.sub(blob, off + 2, off + 15))
  if not v then break end
  if cand == nil then
    cand = {}
    for j = 1, #v, 4 do cand[#cand + 1] = string.sub(v, j, j + 3) end
  elseif not (#cand == 1 and v == cand[1]) then  -- else: one holder that still holds (common)
    local keep = nil  -- built only once a candidate drops out
    for idx, c in ipairs(cand) do
      if holds(v, c) then
        if keep then keep[#keep + 1] = c end
      else
        if not keep then
          keep = {}
          for j = 1, idx - 1 do keep[j] = cand[j] end
        end
        out[#out + 1] = c
        out[#out + 1] = n
      end
    end
    if keep then cand = keep end
  end
  n = n + 1
  if #cand == 0 then break end
end
if cand then
  for _, c in ipairs(cand) do
    out[#out + 1] = c
    out[#out + 1] = n
  end
end
return out
"""
)

_SWEEP = Script(
    """
local pre = ARGV[1]
local first = tonumber(ARGV[2])
local last = tonumber(ARGV[3])
local dead = {}
for j = 1, #ARGV[4], 4 do dead[string.sub(ARGV[4], j, j + 3)] = true end
local removed = 0
for b = first, last do
  local k = pre .. string.char(math.floor(b / 256), b % 256)
  local all = redis.call('HGETALL', k)
  for i = 1, #all, 2 do
    local v = all[i + 1]
    local keep = {}
    for j = 1, #v, 4 do
      local c = string.sub(v, j, j + 3)
      if dead[c] then removed = removed + 1 else keep[#keep + 1] = c end
    end
    if #keep * 4 ~= #v then
      if #keep == 0 then redis.call('HDEL', k, all[i]) else redis.call('HSET', k, all[i], table.concat(keep)) end
    end
  end
end
return removed
"""
)

_SWAP = Script(
    """
local removed = 0
for b = tonumber(ARGV[3]), tonumber(ARGV[4]) do
  local s = string.char(math.floor(b / 256), b % 256)
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


def nid_bytes(nid: int) -> bytes:
    return struct.pack(">I", nid)


def _nids(v: bytes) -> list[int]:
    return [int.from_bytes(v[j : j + 4], "big") for j in range(0, len(v), 4)]


class Index:
    """Reads and writes the index of every namespace under one key prefix (live or rebuild)."""

    def __init__(self, r: Client, prefix: str = keys.BUCKET_PREFIX) -> None:
        self.r = r
        self.prefix = prefix

    def apply_call(self, op: Op, namespace: str, nid: int, blob: bytes) -> Call:
        """The script call applying one INSERT/SNAPSHOT/EVICT batch (``blob`` = 16-byte hashes)."""
        tag = keys.ns_tag(namespace)
        add = "0" if op == Op.EVICT else "1"
        return (
            _APPLY,
            [keys.anchor_key(tag)],
            [keys.bucket_prefix(tag, self.prefix), add, nid_bytes(nid), blob],
        )

    def apply(self, op: Op, namespace: str, nid: int, hashes: Sequence[bytes] | bytes) -> int:
        """Apply one batch now; returns how many (block, nid) pairs changed."""
        blob = hashes if isinstance(hashes, bytes) else b"".join(hashes)
        return run_scripts(self.r, [self.apply_call(op, namespace, nid, blob)])[0]

    def query_command(self, namespace: str, hashes: Sequence[bytes]) -> tuple[str, list[Any]]:
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
    def decode_query(reply: Sequence[Any]) -> dict[int, int]:
        return {int.from_bytes(reply[i], "big"): int(reply[i + 1]) for i in range(0, len(reply), 2)}

    def query(self, namespace: str, hashes: Sequence[bytes]) -> dict[int, int]:
        """nid -> number of leading blocks of ``hashes`` it holds (only nids holding block 0)."""
        anchor, cmd = self.query_command(namespace, hashes)
        return self.decode_query(_QUERY(self.r, [anchor], cmd[4:]))

    def ensure_scripts(self) -> None:
        """Load every script on every shard (a query batch cannot load scripts on its own)."""
        for s in (_APPLY, _QUERY, _SWEEP, _SWAP):
            self.r.script_load(s.source)

    def holders(self, namespace: str, hashes: Sequence[bytes]) -> list[frozenset[int]]:
        """The nids holding each block (one pipelined HGET per block; for tests and tools)."""
        tag = keys.ns_tag(namespace)
        p = self.r.pipeline(transaction=False)
        for h in hashes:
            p.hget(keys.bucket_key(tag, h, self.prefix), h[2:])
        return [frozenset(_nids(v)) if v else frozenset() for v in p.execute()]

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
        for tag in tags:
            anchor = keys.anchor_key(tag)
            pre = keys.bucket_prefix(tag, self.prefix)
            calls: list[Call] = [
                (_SWEEP, [anchor], [pre, first, last, blob])
                for first, last in self._bucket_chunks(tag, SWEEP_CHUNK)
            ]
            for i in range(0, len(calls), 16):
                removed += sum(run_scripts(self.r, calls[i : i + 16]))
        return removed

    def _existing(self, tag: str) -> list[bytes]:
        """Bucket keys of a namespace that exist (SCAN: sparse namespaces cost little)."""
        pat = keys.bucket_prefix(tag, self.prefix) + b"*"
        return sorted(set(self.r.scan_iter(match=pat, count=DUMP_CHUNK)))

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
