"""The decode backup's wire: what nodes and the planning metaserver leave each other in Redis.

The original carries these fields on its HeartbeatNode and PullBackupPlan RPCs
(``has_instance``, ``backup_candidates{namespace, block_hashes, block_bytes}``, a plan's
``source_node``, ``namespace`` and ``block_hashes``); here nodes reach the metaserver only
through Redis, so they are Redis values (docs/architecture.md, "Decode backup"):

- a node's *report* (:func:`report`): whether an engine is registered, since when (Redis's
  clock, kept across reports that say the same) and the most bytes one plan may copy on it
  (``--backup-pull-max-bytes``); one field of ``keys.BACKUP_REPORTS`` per node;
- a node's *offer* (:func:`offer`): its candidates, a snapshot replaced on every tick and
  expiring when the node stops offering (``keys.backup_offer_key``);
- the *targets* the planner chose (``keys.BACKUP_TARGETS``), which nodes read for their role;
- *plans* queued per target (``keys.backup_plan_key``), each naming the source (name, peer
  address, nid), a namespace, its page size and the blocks to copy.

Offers and plans are packed binary (big-endian lengths, then the 16-byte hashes): a full
offer of 16384 candidates is 256 KiB, which JSON would double.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from pegaflow.cluster import keys
from pegaflow.cluster.redis_conn import Client, Script
from pegaflow.core.identity import HASH_BYTES

OFFER = b"O1"  # format tags: a reader refuses what it does not know
PLAN = b"P1"


class MalformedBackup(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Candidates:
    """Blocks of one namespace (pages of ``block_bytes``), oldest first."""

    namespace: str
    block_bytes: int
    hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class Plan:
    """Copy ``blocks.hashes`` from ``source`` (peer ``address``, incarnation ``nid``)."""

    source: str
    address: str
    nid: int
    blocks: Candidates

    @property
    def nbytes(self) -> int:
        return self.blocks.block_bytes * len(self.blocks.hashes)


@dataclass(frozen=True, slots=True)
class Report:
    has_instance: bool
    since_ms: int  # Redis's clock: when the node last changed between engine and no engine
    pull_max_bytes: int


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def _pack(c: Candidates) -> bytes:
    return _str(c.namespace) + struct.pack(">QI", c.block_bytes, len(c.hashes)) + b"".join(c.hashes)


class _Reader:
    def __init__(self, blob: bytes, tag: bytes) -> None:
        if blob[:2] != tag:
            raise MalformedBackup(f"backup value of {len(blob)} bytes starting {blob[:2]!r}, not {tag!r}")
        self.blob = blob
        self.pos = 2

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.blob):
            raise MalformedBackup(f"backup value cut short at byte {self.pos} of {len(self.blob)}")
        out = self.blob[self.pos:self.pos + n]
        self.pos += n
        return out

    def str(self) -> str:
        (n,) = struct.unpack(">H", self.take(2))
        return self.take(n).decode()

    def candidates(self) -> Candidates:
        ns = self.str()
        block_bytes, count = struct.unpack(">QI", self.take(12))
        blob = self.take(count * HASH_BYTES)
        return Candidates(ns, block_bytes, [blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)])

    @property
    def done(self) -> bool:
        return self.pos == len(self.blob)


def encode_offer(groups: Sequence[Candidates]) -> bytes:
    return OFFER + b"".join(map(_pack, groups))


def decode_offer(blob: bytes) -> list[Candidates]:
    rd = _Reader(blob, OFFER)
    out = []
    while not rd.done:
        out.append(rd.candidates())
    return out


def encode_plan(plan: Plan) -> bytes:
    return PLAN + _str(plan.source) + _str(plan.address) + struct.pack(">Q", plan.nid) + _pack(plan.blocks)


def decode_plan(blob: bytes) -> Plan:
    rd = _Reader(blob, PLAN)
    source, address = rd.str(), rd.str()
    (nid,) = struct.unpack(">Q", rd.take(8))
    plan = Plan(source, address, nid, rd.candidates())
    if not rd.done:
        raise MalformedBackup(f"{len(rd.blob) - rd.pos} bytes after a backup plan")
    return plan


# ARGV: node, has engine (0|1), pull max bytes. The stamp moves only when the first field changes.
_REPORT = Script("""
local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local since = now
if cur then
  local inst, s = string.match(cur, '^(%d):(%d+):')
  if inst == ARGV[2] then since = tonumber(s) end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. string.format('%.0f', since) .. ':' .. ARGV[3])
return 1
""")


def report(r: Client, node: str, has_instance: bool, pull_max_bytes: int) -> None:
    _REPORT(r, [keys.BACKUP_REPORTS], [node, "1" if has_instance else "0", pull_max_bytes])


def parse_report(value: bytes | str) -> Report:
    text = value.decode() if isinstance(value, bytes) else value
    try:
        inst, since, most = text.split(":")
        return Report(inst == "1", int(since), int(most))
    except ValueError:
        raise MalformedBackup(f"backup report {text!r}") from None


def reports(r: Client) -> dict[str, Report]:
    """node -> its last report (malformed ones left out)."""
    out = {}
    for k, v in cast("dict[bytes, bytes]", r.hgetall(keys.BACKUP_REPORTS)).items():
        try:
            out[k.decode()] = parse_report(v)
        except MalformedBackup:
            continue
    return out


def offer(r: Client, node: str, groups: Sequence[Candidates], ttl_ms: int) -> None:
    """Replace ``node``'s offer (none: remove it)."""
    if groups:
        r.set(keys.backup_offer_key(node), encode_offer(groups), px=ttl_ms)
    else:
        r.delete(keys.backup_offer_key(node))


def read_offer(r: Client, node: str) -> list[Candidates]:
    blob = cast("bytes | None", r.get(keys.backup_offer_key(node)))
    return decode_offer(blob) if blob else []


# ARGV: ttl ms, then the targets: one step, so a node never reads an empty set between passes.
_TARGETS = Script("""
redis.call('DEL', KEYS[1])
if #ARGV > 1 then
  redis.call('SADD', KEYS[1], unpack(ARGV, 2))
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
return 1
""")


def set_targets(r: Client, names: Sequence[str], ttl_ms: int) -> None:
    _TARGETS(r, [keys.BACKUP_TARGETS], [ttl_ms, *names])


def is_target(r: Client, node: str) -> bool:
    return bool(r.sismember(keys.BACKUP_TARGETS, node))


def queue_plans(r: Client, target: str, plans: Sequence[Plan], ttl_ms: int) -> None:
    key = keys.backup_plan_key(target)
    p = r.pipeline(transaction=False)  # one key; a plan list without its TTL expires at the next push
    p.rpush(key, *map(encode_plan, plans))
    p.pexpire(key, ttl_ms)
    p.execute()


def queued(r: Client, target: str) -> int:
    return int(r.llen(keys.backup_plan_key(target)))


def pop_plan(r: Client, node: str) -> Plan | None:
    blob = cast("bytes | None", r.lpop(keys.backup_plan_key(node)))
    return decode_plan(blob) if blob else None
