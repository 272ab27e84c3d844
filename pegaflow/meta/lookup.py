"""Read side: QueryPrefix and the routing hint, from the replica's in-memory view while it
is fresh (``view_feed.py``, ``--view-max-lag-ms``), else one Redis round trip each.

From the view: one walk of the view in C (``view.PrefixView.walk``), liveness from the
view's last round (a node that dies leaves answers within the bound, not at once).

From Redis: a lookup sends, together, the prefix query (a batch of ``HGET``, namespace slot; see
``index.py``) and ``MGET`` of every known node's liveness key plus ``GET`` of the registry
version (``{pf}`` slot); on a cluster the two go to their shards in parallel
(``redis_conn.raw_round_trip``; without a real socket, the prefix script through
``redis_conn.parallel``). Nids not visible in that
same round trip are dropped, so a node whose TTL expired disappears from answers at once.
With ``stale_ms`` (the metaserver's ``--node-stale-secs``) the same round trip also reads
the nodes' last heartbeat stamps and Redis's clock, and a node whose last heartbeat is
older is dropped too (``registry.fresh``), the original's stale filtering.
The name/address cache is reloaded only when the registry version moved (then, and only
then, a lookup costs a second round trip).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from prometheus_client import Counter
from redis.exceptions import NoScriptError, ResponseError

from pegaflow.cluster import keys, registry
from pegaflow.cluster.redis_conn import Client, checked, is_cluster, parallel, raw_round_trip, relearn
from pegaflow.core.tiers import Tier
from pegaflow.meta.index import Index, prefix_tiers
from pegaflow.meta.view_feed import ViewFeed

log = structlog.get_logger("pegaflow.meta.lookup")


@dataclass(frozen=True)
class NodePrefix:
    node: str
    address: str
    prefix_len: int
    ssd_blocks: int = 0  # of prefix_len, held only on the node's SSD tier

    @property
    def tier(self) -> Tier:
        return Tier.SSD if self.ssd_blocks else Tier.L1


class Lookup:
    """Thread-safe; one instance per process serves every gRPC handler thread.

    With ``view``, a lookup is answered from it while it is fresh (it says so by answering),
    else from Redis; ``sources`` (labelled by ``source``: ``view``, ``redis``) counts which.
    """

    def __init__(self, r: Client, stale_ms: int | None = None, view: ViewFeed | None = None,
                 sources: Counter | None = None) -> None:
        self.r = r
        self.stale_ms = stale_ms
        self.view = view
        counts = sources if sources is not None else Counter("lookups", "", ["source"], registry=None)
        self._from_view, self._from_redis = counts.labels("view"), counts.labels("redis")
        self._warned_slow: set[str] = set()
        self.index = Index(r)
        self._lock = threading.Lock()
        self._version = -1
        self._names: list[str] = []
        self._addrs: dict[str, str] = {}
        self.index.ensure_scripts()

    def _reload(self) -> None:
        ver = registry.version(self.r)
        nodes = registry.nodes(self.r)
        if self.stale_ms is not None:
            for n, i in nodes.items():
                # A node refreshes its liveness every third of its --liveness-ttl: slower than
                # the staleness bound, it would drop out of answers between heartbeats.
                if i.ttl_ms / 3 >= self.stale_ms and n not in self._warned_slow:
                    self._warned_slow.add(n)
                    log.warning("node_heartbeats_slower_than_stale", node=n, heartbeat_every_s=i.ttl_ms / 3000,
                                node_stale_secs=self.stale_ms / 1000)
        with self._lock:
            self._names = sorted(nodes)
            self._addrs = {n: i.addr for n, i in nodes.items()}
            self._version = ver

    def query_prefix(self, namespace: str, hashes: Sequence[bytes]) -> list[NodePrefix]:
        """Live nodes holding a non-empty prefix of ``hashes``, longest first (ties: fewer
        blocks only on SSD first, then by name)."""
        if not hashes:
            return []
        if self.view is not None:
            rows = self.view.holders(namespace, hashes)
            if rows is not None:
                self._from_view.inc()
                got = [NodePrefix(*row) for row in rows]
                got.sort(key=lambda p: (-p.prefix_len, p.ssd_blocks, p.node))
                return got
        self._from_redis.inc()
        batch = self.index.query_batch(namespace, hashes)
        for attempt in range(3):
            names = self._names
            reg_cmds = [["GET", keys.VERSION]]
            if names:
                reg_cmds += registry.visibility_commands(names)
            raw = raw_round_trip(self.r, [batch, (keys.VERSION, reg_cmds, len(reg_cmds))])
            if raw is not None:
                try:
                    values, rrep = checked(raw[0]), checked(raw[1])
                except ResponseError as exc:
                    if is_cluster(self.r) and str(exc).startswith(("MOVED", "ASK")) and attempt < 2:
                        relearn(self.r)  # resharded: re-learn who owns the slot
                        continue
                    raise
                held = prefix_tiers(values)
            else:  # no real socket (fakeredis): the prefix script
                anchor, qcmd = self.index.query_command(namespace, hashes)
                qrep, rrep = parallel(self.r, [(anchor, [qcmd]), (keys.VERSION, reg_cmds)])
                if isinstance(qrep[0], Exception):
                    if isinstance(qrep[0], NoScriptError) and attempt < 2:
                        self.index.ensure_scripts()
                        continue
                    raise qrep[0]
                for rep in rrep:
                    if isinstance(rep, Exception):
                        raise rep
                held = Index.decode_query_tiers(qrep[0])
            if int(rrep[0] or 0) != self._version and attempt < 2:
                self._reload()
                continue
            visible = registry.fresh(names, rrep[1], rrep[2], registry.redis_ms(rrep[3]), self.stale_ms) if names else {}
            out = [
                NodePrefix(visible[nid], self._addrs.get(visible[nid], ""), h.prefix_len, h.ssd_blocks)
                for nid, h in held.items()
                if nid in visible and h.prefix_len > 0
            ]
            out.sort(key=lambda p: (-p.prefix_len, p.ssd_blocks, p.node))
            return out
        raise RuntimeError("registry kept changing during the lookup")

    def nodes(self) -> list[tuple[str, str, int, bool]]:
        """(name, address, epoch, alive) of every registered node."""
        info = registry.nodes(self.r)
        vis = set(registry.visible(self.r, sorted(info), self.stale_ms).values())
        return [(n, i.addr, i.epoch, n in vis) for n, i in sorted(info.items())]
