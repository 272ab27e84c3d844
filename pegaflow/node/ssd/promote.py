"""Promotion: bring blocks a Query found on SSD back into L1, asynchronously.

Contracts:
- :meth:`Promoter.query` runs inside the Query handler (event loop) and never waits. It
  extends the L1 prefix with the blocks found on SSD (for every namespace of the query),
  reserves node-owned PENDING pages for them (``BlockIndex.reserve``; PENDING pages are
  invisible and never evicted), and issues the reads. It returns True (answer LOADING)
  while the first block after the L1 prefix is being promoted, so the engine's next
  Query finds it in L1 (READY). With no L1 space or nothing on SSD it returns False and
  the Query answers READY with the L1 prefix: LOADING is never answered for blocks that
  are not on their way.
- A promoted page is committed (made visible) only after its header matches the index
  entry (namespace, hash, generation, sequence, length) and its payload checksum
  matches; otherwise the page is discarded, the SSD entry dropped and the failure
  counted. Corrupt bytes are a miss, never served.
- While a promotion runs, the query's L1 prefix is pinned, and every block of the batch
  stays pinned for ``HOLD_SECONDS`` after the batch completed, so the engine's next
  Query finds (and leases) them. Without this, a request larger than the free L1 would
  evict its own prefix to make room for its continuation, forever; with it, the later
  Query answers READY with as much of the prefix as L1 can hold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pegaflow.node.block_index import RESIDENT, Block, Namespace
from pegaflow.node.ssd.store import BLOCK, Entry, aligned_buffer, checksum, round_up, unpack_header
from pegaflow.node.ssd.uring import IoOp

if TYPE_CHECKING:
    from pegaflow.node.ssd.tier import SsdTier

HOLD_SECONDS = 2.0  # pin promoted blocks this long for the engine's next Query to lease them


@dataclass(eq=False)
class _Batch:
    """Blocks promoted for one Query; latency is observed when the last one lands."""

    t0: float
    remaining: int = 0
    pinned: list[Block] = field(default_factory=list)


class Promoter:
    def __init__(self, tier: SsdTier) -> None:
        self.tier = tier
        self.inflight: dict[tuple[int, bytes], Block] = {}

    def query(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> bool:
        """Start promoting the SSD continuation of an L1 prefix of length ``hit``."""
        t = self.tier
        index, store, inflight = t.index, t.store, self.inflight
        end = len(hashes)
        j = hit
        while j < end:
            h = hashes[j]
            if not all(index.get(ns, h) is not None or (ns.id, h) in inflight or (ns.id, h) in store.entries
                       for ns in nss):
                break
            j += 1
        if j == hit:
            return False
        batch = _Batch(time.perf_counter())
        prefix = [b for ns in nss for b in index.prefix(ns, hashes[:hit], touch=False)]
        index.pin(prefix)
        batch.pinned.extend(prefix)
        ops: list[IoOp] = []
        for ns in nss:
            need = [h for h in hashes[hit:j]
                    if index.get(ns, h) is None and (ns.id, h) not in inflight and (ns.id, h) in store.entries]
            if not need:
                continue
            for h, b in zip(need, index.reserve(ns, need), strict=True):
                if b is None:
                    continue
                key = (ns.id, h)
                e = store.entries[key]
                inflight[key] = b
                batch.remaining += 1
                ops.append(self._read(key, b, e, batch))
        if ops:
            t.metrics_node_hits(len(ops))
            t.engine.submit(ops)
        else:
            self._unpin(batch)
        h0 = hashes[hit]
        return all(index.get(ns, h0) is not None or (ns.id, h0) in inflight for ns in nss)

    def _read(self, key: tuple[int, bytes], b: Block, e: Entry, batch: _Batch) -> IoOp:
        t = self.tier
        view = t.pool_view
        hdr = aligned_buffer(BLOCK)
        page = view[b.offset:b.offset + round_up(b.size)]
        total = BLOCK + len(page)
        name = b.ns.name

        def complete(res: int) -> None:
            # engine thread: verify before the loop may publish the page
            if res != total:
                t.call_soon(self._done, key, b, e, batch, "io_error")
                return
            h = unpack_header(hdr)
            ok = (h is not None and h.hash == b.hash and h.ns_name == name and h.gen == e.gen
                  and h.seq == e.seq and h.payload_len == b.size
                  and checksum(view[b.offset:b.offset + b.size]) == h.payload_csum)
            t.call_soon(self._done, key, b, e, batch, "ok" if ok else "checksum")

        return IoOp(False, t.store.files[e.file].fd, e.offset, [hdr, page], complete)

    def _done(self, key: tuple[int, bytes], b: Block, e: Entry, batch: _Batch, outcome: str) -> None:
        t = self.tier
        m = t.metrics
        self.inflight.pop(key, None)
        if outcome == "ok":
            t.promoting.add(key)
            try:
                t.index.commit((b,))
            finally:
                t.promoting.discard(key)
            if b.state == RESIDENT:
                t.index.pin((b,))
                batch.pinned.append(b)
            m.promoted.inc()
            m.read_bytes.inc(b.size)
        else:
            t.index.discard((b,))
            if t.store.get(key) is e:
                t.store.remove(key)
            if outcome == "checksum":
                m.checksum_failures.inc()
                t.log_checksum_failure(e)
            else:
                m.read_errors.inc()
                t.log_io_error("read", 1)
        batch.remaining -= 1
        if batch.remaining == 0:
            m.promote_latency.observe(time.perf_counter() - batch.t0)
            assert t.loop is not None
            t.loop.call_later(HOLD_SECONDS, self._unpin, batch)

    def _unpin(self, batch: _Batch) -> None:
        self.tier.index.unpin(batch.pinned)
        batch.pinned = []
