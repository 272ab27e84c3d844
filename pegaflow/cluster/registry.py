"""Node incarnations and liveness, all in the ``{pf}`` slot.

An incarnation is ``(node, epoch)`` with an integer ``nid`` from a counter that is never
reused. The registry keeps, per node, its newest incarnation (``pf:{pf}:nodes``) and a
liveness key ``pf:{pf}:live:<node>`` whose *value* is the nid readers see and whose TTL
the node refreshes. Hence:

- A dead node (TTL expired) is invisible at once: its live key is gone. Its registration
  and entries stay until it has been silent for the metaserver's ``--ttl-minutes`` (no
  heartbeat, no event; the original's "minutes without node activity before lifecycle
  cleanup"): then the sweeper reaps it (:func:`reap`), retiring its nid and removing its
  entries. A node that heartbeats again before that gets its live key back with the same
  nid (:func:`heartbeat`): visible again with every entry it had, as the original's
  session that recovers before cleanup.
- A restarted node registers with ``switch=True``: readers see the new nid at once
  (the old one's entries are stale: the node lost its memory) while the snapshot fills it.
- A node re-syncing in-process (after dropped events or to compact its stream) registers
  with ``switch=False``: readers keep the old nid until the consumer applies the new
  epoch's last snapshot chunk and calls :func:`switch`. The node's record keeps that old
  nid (``prev``) meanwhile, so it is retired however the re-sync ends: the switch, or the
  node's liveness lapsing first (a heartbeat then makes the new nid the live one, a reap
  or a new registration retires both).
- A node that stops cleanly deletes its live key (:func:`leave`): invisible at once, not
  after its TTL; its registration stays as a dead node's does.
- Every change of the visible set bumps ``pf:{pf}:ver`` so readers refresh their cache.
- Registration and every heartbeat also stamp the node's entry of ``pf:{pf}:seen`` with
  Redis's clock (one clock for every host). A metaserver's ``--node-stale-secs`` (the
  original's: a node is hidden from answers after that long without a heartbeat) is
  applied by readers against it (:func:`fresh`), in the same round trip as the live keys:
  a node is visible while its live key exists **and** its last heartbeat is at most that
  old. So the earlier of the two hides it: the node's own ``--liveness-ttl`` (after which
  the sweeper may reap it once it has been silent for ``--ttl-minutes``) or the
  metaserver's staleness. A stale node that heartbeats again is visible again at once;
  nothing of it is removed before ``--ttl-minutes`` of silence.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from pegaflow.cluster import keys
from pegaflow.cluster.redis_conn import Client, Script, parallel

if TYPE_CHECKING:
    from redis.typing import EncodableT

_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

_REGISTER = Script(
    _NOW
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local epoch = tonumber(ARGV[7])
local old = nil
local prev = nil
if cur then
  local c = cjson.decode(cur)
  epoch = c.epoch + 1
  old = tostring(c.nid)
  if c.prev then prev = tostring(c.prev) end
end
-- A fresh (or emptied) Redis starts nids at a random base and a node's first epoch at a
-- random value: events written before the loss (a node notices it only at its next
-- heartbeat) then name an incarnation that does not exist now, instead of another
-- node's new one, and the consumer drops them.
redis.call('SET', KEYS[2], ARGV[6], 'NX')
local nid = redis.call('INCR', KEYS[2])
local rec = {nid = nid, epoch = epoch, addr = ARGV[2], ttl = tonumber(ARGV[3])}
redis.call('HSET', KEYS[6], ARGV[1], now)
local vis = redis.call('GET', KEYS[5])
if ARGV[4] == '1' or not vis then
  if vis then redis.call('ZADD', KEYS[4], now, vis) end
  redis.call('SET', KEYS[5], nid, 'PX', ARGV[3])
else
  -- The incarnation still visible until the new one switches (an in-process re-sync): kept
  -- in the record, so whichever way it ends (switch, expiry and heartbeat, reap, another
  -- registration) retires it.
  redis.call('PEXPIRE', KEYS[5], ARGV[3])
  rec.prev = tonumber(vis)
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(rec))
if old and old ~= vis then redis.call('ZADD', KEYS[4], now, old) end
if prev and prev ~= vis and prev ~= old then redis.call('ZADD', KEYS[4], now, prev) end
-- A fresh (or emptied) Redis starts the version at a random base, so a reader's cached
-- version from before the loss cannot match by accident.
redis.call('SET', KEYS[3], ARGV[5], 'NX')
redis.call('INCR', KEYS[3])
return {nid, epoch}
"""
)

# Refresh the live key of the newest incarnation; when it expired (but the node was not
# reaped yet) set it again: the node is visible again with the entries it kept.
_HEARTBEAT = Script(
    _NOW
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local c = cjson.decode(cur)
if c.nid ~= tonumber(ARGV[2]) then return 0 end
if redis.call('PEXPIRE', KEYS[2], ARGV[3]) == 0 then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  redis.call('INCR', KEYS[4])
  if c.prev then  -- the re-sync's old incarnation lost its liveness: superseded now
    redis.call('ZADD', KEYS[5], now, c.prev)
    c.prev = nil
    redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(c))
  end
end
redis.call('HSET', KEYS[3], ARGV[1], now)
return 1
"""
)

# A node that stops cleanly: its live key goes at once (readers skip it without waiting for
# the TTL) while ARGV[2] is still its newest incarnation; its registration stays (a restart
# registers anew, the sweeper reaps it after --ttl-minutes).
_LEAVE = Script(
    """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
if cjson.decode(cur).nid ~= tonumber(ARGV[2]) then return 0 end
if redis.call('DEL', KEYS[2]) == 0 then return 0 end
redis.call('INCR', KEYS[3])
return 1
"""
)

_SWITCH = Script(
    _NOW
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local c = cjson.decode(cur)
if c.nid ~= tonumber(ARGV[2]) then return 0 end
local vis = redis.call('GET', KEYS[2])
if not vis then return 0 end
if c.prev then
  if tostring(c.prev) ~= vis then redis.call('ZADD', KEYS[3], now, c.prev) end
  c.prev = nil
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(c))
end
if vis == ARGV[2] then return 1 end
redis.call('ZADD', KEYS[3], now, vis)
redis.call('SET', KEYS[2], ARGV[2], 'KEEPTTL')
redis.call('INCR', KEYS[4])
return 2
"""
)

# Retire the newest nid of nodes whose live key is gone and whose last registration or
# heartbeat is more than ARGV[1] ms old (0, or a node without a stamp: the live key alone); forget
# them in the registry and its decode-backup report. KEYS[5 + i] is the live key of ARGV[1 + i]
# (keys.live_key).
_REAP = Script(
    _NOW
    + """
local out = {}
local idle = tonumber(ARGV[1])
for i = 1, #ARGV - 1 do
  local name = ARGV[1 + i]
  local seen = redis.call('HGET', KEYS[4], name)
  if redis.call('EXISTS', KEYS[5 + i]) == 0 and (idle <= 0 or not seen or now - tonumber(seen) > idle) then
    local cur = redis.call('HGET', KEYS[1], name)
    if cur then
      local c = cjson.decode(cur)
      redis.call('ZADD', KEYS[2], now, c.nid)
      if c.prev then redis.call('ZADD', KEYS[2], now, c.prev) end
      redis.call('HDEL', KEYS[1], name)
      redis.call('HDEL', KEYS[4], name)
      redis.call('HDEL', KEYS[5], name)
      out[#out + 1] = name
    end
  end
end
if #out > 0 then redis.call('INCR', KEYS[3]) end
return out
"""
)


@dataclass(frozen=True)
class NodeInfo:
    name: str
    nid: int  # newest incarnation (may not be visible yet)
    epoch: int
    addr: str
    ttl_ms: int = 0  # the node's --liveness-ttl (0: registered by a version that did not say)


def register(r: Client, node: str, addr: str, ttl_ms: int, switch: bool) -> tuple[int, int]:
    """Start a new incarnation of ``node``; returns ``(nid, epoch)``."""
    nid, epoch = _REGISTER(
        r,
        [keys.NODES, keys.NEXT_NID, keys.VERSION, keys.RETIRED, keys.live_key(node), keys.SEEN],
        [node, addr, ttl_ms, "1" if switch else "0", random.randrange(1 << 40), random.randrange(1 << 20, 1 << 30),
         random.randrange(1, 1 << 40)],
    )
    return int(nid), int(epoch)


def heartbeat(r: Client, node: str, nid: int, ttl_ms: int) -> bool:
    """Refresh liveness (a live key that expired is set again while ``nid`` is still the
    node's registration); False when the registration is gone or superseded (reaped after
    ``--ttl-minutes`` of silence, Redis lost data): re-register."""
    return bool(_HEARTBEAT(r, [keys.NODES, keys.live_key(node), keys.SEEN, keys.VERSION, keys.RETIRED],
                           [node, nid, ttl_ms]))


def leave(r: Client, node: str, nid: int) -> bool:
    """A clean stop: hide ``node`` now (delete its live key) if ``nid`` is still its newest
    incarnation (the live key may name the one it re-syncs from: that is this node too);
    False when there was nothing to hide or another incarnation took the name."""
    return bool(_LEAVE(r, [keys.NODES, keys.live_key(node), keys.VERSION], [node, nid]))


def rival(r: Client, node: str, nid: int, addr: str) -> NodeInfo | None:
    """The live incarnation of another process that took ``node``'s name (two nodes given
    one --node-id): the registration names a nid other than ``nid`` and an address other
    than ``addr``, and the name's live key exists. None when the name is free to register
    again (its registration gone, or ours, or the other one dead)."""
    p = r.pipeline(transaction=False)
    p.hget(keys.NODES, node)
    p.get(keys.live_key(node))
    cur, live = p.execute()
    if cur is None or live is None:
        return None
    d = json.loads(cur)
    if int(d["nid"]) == nid or str(d["addr"]) == addr:
        return None
    return NodeInfo(node, int(d["nid"]), int(d["epoch"]), str(d["addr"]), int(d.get("ttl", 0)))


def switch(r: Client, node: str, nid: int) -> int:
    """Make ``nid`` the visible incarnation of ``node`` if it is still the newest and alive.

    Returns 0 (superseded or dead: nothing done), 1 (already visible), 2 (switched).
    """
    return int(_SWITCH(r, [keys.NODES, keys.live_key(node), keys.RETIRED, keys.VERSION], [node, nid]))


def reap(r: Client, names: list[str], idle_ms: int = 0) -> list[str]:
    """Retire and unregister the nodes among ``names`` whose liveness expired and that have
    not registered or heartbeat for more than ``idle_ms`` (Redis's clock); returns them."""
    if not names:
        return []
    got = _REAP(r, [keys.NODES, keys.RETIRED, keys.VERSION, keys.SEEN, keys.BACKUP_REPORTS,
                    *map(keys.live_key, names)],
                [idle_ms, *names])
    return [n.decode() for n in got]


def nodes(r: Client) -> dict[str, NodeInfo]:
    out = {}
    for k, v in cast("dict[bytes, bytes]", r.hgetall(keys.NODES)).items():
        name = k.decode()
        d = json.loads(v)
        out[name] = NodeInfo(name, int(d["nid"]), int(d["epoch"]), str(d["addr"]), int(d.get("ttl", 0)))
    return out


def redis_ms(time_reply: Sequence[bytes | str | int]) -> int:
    """Milliseconds of a Redis ``TIME`` reply (``[seconds, microseconds]``)."""
    return int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000


def fresh(
    names: Sequence[str],
    live: Sequence[bytes | str | None],
    seen: Sequence[bytes | str | None],
    now_ms: int,
    stale_ms: int | None,
) -> dict[int, str]:
    """nid -> name of the visible nodes among ``names``: a live key (``live``, the ``MGET``
    of their live keys) and, with ``stale_ms``, a last heartbeat (``seen``, the ``HMGET``
    of ``SEEN``) at most ``stale_ms`` before ``now_ms`` (Redis's clock). A node without a
    stamp (registered by an older version) is judged by its live key alone."""
    out = {}
    for i, (n, v) in enumerate(zip(names, live, strict=True)):
        if v is None:
            continue
        if stale_ms is not None and (stamp := seen[i]) is not None and now_ms - int(stamp) > stale_ms:
            continue
        out[int(v)] = n
    return out


def visible(r: Client, names: list[str], stale_ms: int | None = None) -> dict[int, str]:
    """nid -> node name for the live nodes among ``names`` (with ``stale_ms``: those that
    also heartbeat within it)."""
    if not names:
        return {}
    if stale_ms is None:
        return fresh(names, r.mget([keys.live_key(n) for n in names]), [None] * len(names), 0, None)
    # One connection to the registry's shard: TIME is that server's clock (a cluster
    # pipeline would send the keyless TIME to any node).
    (replies,) = parallel(r, [(keys.VERSION, visibility_commands(names))])
    for rep in replies:
        if isinstance(rep, Exception):
            raise rep
    live, seen, now = replies
    return fresh(names, live, seen, redis_ms(now), stale_ms)


def visibility_commands(names: Sequence[str]) -> list[list[str]]:
    """The registry-shard commands whose replies :func:`fresh` reads: the live keys, the
    heartbeat stamps and the server's clock (route them by ``keys.VERSION``)."""
    return [["MGET", *(keys.live_key(n) for n in names)], ["HMGET", keys.SEEN, *names], ["TIME"]]


def retired(r: Client) -> set[int]:
    return {int(m) for m in cast("list[bytes]", r.zrange(keys.RETIRED, 0, -1))}


def namespace_tags(r: Client) -> list[str]:
    """The tags of every namespace the index holds (``keys.NAMESPACES``: tag -> namespace)."""
    return [t.decode() for t in cast("list[bytes]", r.hkeys(keys.NAMESPACES))]


def add_namespace_tags(r: Client, tags: Mapping[str, str]) -> None:
    """Record ``tags`` (tag -> namespace) in ``keys.NAMESPACES``."""
    # Cast: redis-py types ``mapping`` with an invariant key, which a Mapping[str, str] is not.
    r.hset(keys.NAMESPACES, mapping=cast("Mapping[EncodableT, EncodableT]", tags))


def version(r: Client) -> int:
    return int(r.get(keys.VERSION) or 0)
