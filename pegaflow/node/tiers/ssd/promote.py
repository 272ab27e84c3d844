"""Promotion: bring blocks a Query found on SSD back into L1, asynchronously.

Contracts:
- :meth:`Promoter.query` runs inside the Query handler (event loop) and never waits. It
  extends the L1 prefix with the blocks found on SSD (for every namespace of the query),
  reserves node-owned PENDING pages for them (``BlockIndex.reserve``; PENDING pages are
  invisible and never evicted), and issues the reads. It returns True (answer LOADING)
  while blocks that would extend the L1 prefix are being promoted, so the engine's next
  Query finds the whole continuation in L1 (READY). With no L1 space or nothing on SSD it returns False and
  the Query answers READY with the L1 prefix: LOADING is never answered for blocks that
  are not on their way.
- A promoted page is committed (made visible) only after its header matches the index
  entry (namespace, hash, generation, sequence, length) and its payload checksum
  matches; otherwise the page is discarded, the SSD entry dropped and the failure
  counted. Corrupt bytes are a miss, never served.
- At most ``--max-prefetch-blocks`` blocks are read at once; a Query finding more on SSD
  promotes the front of its continuation only (LOADING for that part, as above).
- One Query's reads are one batch for the read gate (``gate.py``): at most
  ``--ssd-prefetch-inflight`` read I/Os in flight; when ``--ssd-prefetch-queue-depth``
  batches already wait for a slot, the Query promotes nothing new (as the original drops
  a prefetch batch offered to its full channel) and the blocks are counted in
  ``pegaflow_node_ssd_prefetch_dropped_blocks_total``; it answers with what is already on
  its way, or READY with the L1 prefix.
- :meth:`Promoter.stage` serves a peer's pin instead (pegaflow/node/tiers/remote/pins.py):
  the same reads into PENDING pages that are never committed here, headers checked but
  payloads not hashed (the puller verifies them against the records' checksums it is
  handed), owned and freed by the pin; they count against ``--max-prefetch-blocks`` too.
- While a promotion runs, what L1 holds of the query's blocks is pinned, and every
  block of the batch stays pinned after it completed until a Query leases all of them
  (:meth:`Promoter.leased`: the lease pins them from then on) or ``HOLD_SECONDS`` pass,
  so the next Query finds (and leases) them. Without the hold, a request larger than the
  free L1 would evict its own prefix to make room for its continuation, forever; with it,
  the later Query answers READY with as much of the prefix as L1 can hold. Ending the
  hold at the lease matters on a small pool: held pages cannot be evicted, and requests
  promoted one after the other within ``HOLD_SECONDS`` found no room (misses of blocks
  that were on SSD).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from pegaflow.core.block_index import Block, Namespace
from pegaflow.node.tiers.ssd.metrics import IoClock
from pegaflow.node.tiers.ssd.parts import TierParts
from pegaflow.node.tiers.ssd.records import BLOCK, aligned_buffer, checksum, round_up, unpack_header
from pegaflow.node.tiers.ssd.store import Entry
from pegaflow.node.tiers.ssd.uring import MAX_IOV, IoOp

HOLD_SECONDS = 2.0  # pin promoted blocks this long for the engine's next Query to lease them
READ_COALESCE_BYTES = 4 << 20  # records adjacent on disk are read by one readv up to this size


@dataclass(eq=False)
class _Batch:
    """Blocks promoted for one Query; latency is observed when the last one lands."""

    t0: float
    remaining: int = 0
    pinned: list[Block] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None  # ends the hold (set when the batch completed)


@dataclass(eq=False)
class _Stage:
    """Records read for one peer's pin (:meth:`Promoter.stage`); ``out`` fills as reads land."""

    fut: asyncio.Future[None]
    remaining: int
    out: dict[tuple[int, bytes], tuple[Block, int]] = field(default_factory=dict)
    abandoned: bool = False  # the pin gave up (cancelled): pages are discarded as they land


@dataclass(slots=True, eq=False)
class _Rec:
    key: tuple[int, bytes]
    block: Block
    entry: Entry
    hdr: bytearray


async def _until(f: asyncio.Future[None], timeout: float) -> None:
    """Wait for ``f`` at most ``timeout`` seconds (then drop it)."""
    if timeout > 0:
        await asyncio.wait((f,), timeout=timeout)
    if not f.done():
        f.cancel()


def _runs(recs: list[_Rec]) -> list[list[_Rec]]:
    """Group records adjacent on disk (same file, contiguous) into runs for one readv each."""
    recs = sorted(recs, key=lambda r: (r.entry.file, r.entry.offset))
    runs: list[list[_Rec]] = []
    size = 0
    for r in recs:
        last = runs[-1][-1] if runs else None
        if (last is not None and last.entry.file == r.entry.file
                and last.entry.offset + last.entry.size == r.entry.offset
                and size + r.entry.size <= READ_COALESCE_BYTES and 2 * len(runs[-1]) + 2 <= MAX_IOV):
            runs[-1].append(r)
            size += r.entry.size
        else:
            runs.append([r])
            size = r.entry.size
    return runs


class Promoter:
    def __init__(self, tier: TierParts, max_blocks: int) -> None:
        self.tier = tier
        self.max_blocks = max_blocks  # --max-prefetch-blocks: reads in flight at most (back-pressure)
        self.inflight: dict[tuple[int, bytes], Block] = {}
        self.staging = 0  # blocks being read for peers' pins (stage()): they count against max_blocks too
        self._hdrs: list[bytearray] = []  # free 4 KiB header buffers (aligned)
        self._holding: dict[int, list[_Batch]] = {}  # id(block) -> completed batches that hold it
        self._waiters: list[asyncio.Future[None]] = []  # landed(): resolved when the next read lands

    def _room(self) -> int:
        """Blocks that may start reading now: ``--max-prefetch-blocks`` less those being
        promoted and those being read for peers' pins."""
        return max(0, self.max_blocks - len(self.inflight) - self.staging)

    def landed(self) -> asyncio.Future[None]:
        """A future resolved when the next read (one readv of adjacent records) has landed,
        committed or not: a stage waiting for read slots wakes when one frees, not on a poll."""
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(f)
        return f

    def query(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int) -> int:
        """Start promoting the SSD continuation of an L1 prefix of length ``hit``; returns
        the prefix length it will reach (0: nothing to wait for)."""
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
            return 0
        batch = _Batch(time.perf_counter())
        # Pin what L1 already holds of hashes[:j] (the prefix, and continuation blocks one
        # shard has): the reservations below must not evict them.
        held = [b for ns in nss for b in index.prefix(ns, hashes[:hit], touch=False)]
        held += [b for ns in nss for h in hashes[hit:j] if (b := index.get(ns, h)) is not None]
        index.pin(held)
        batch.pinned.extend(held)
        recs: list[_Rec] = []
        dropping = t.reads.full()
        for ns in nss:
            need = [h for h in hashes[hit:j]
                    if index.get(ns, h) is None and (ns.id, h) not in inflight and (ns.id, h) in store.entries]
            # Back-pressure: beyond the limit the rest is not promoted now; _loading then answers
            # with the prefix that is on its way, and the engine's next Query promotes more.
            room = self._room()
            if len(need) > room:
                t.metrics.prefetch_deferred.inc(len(need) - room)
                need = need[:room]
            if need and dropping:
                t.metrics.prefetch_dropped.inc(len(need))
                continue
            if not need:
                continue
            for h, b in zip(need, index.reserve(ns, need), strict=True):
                if b is None:
                    continue
                key = (ns.id, h)
                inflight[key] = b
                recs.append(_Rec(key, b, store.entries[key], self._hdr()))
        if recs:
            batch.remaining = len(recs)
            t.metrics_node_hits(len(recs))
            done = functools.partial(self._done, batch)
            accepted = t.reads.offer([self._read(run, done) for run in _runs(recs)])
            assert accepted, "checked above: at most queue_depth batches wait"
        else:
            self._unpin(batch)
        return self._loading(nss, hashes, hit, j)

    def _loading(self, nss: Sequence[Namespace], hashes: Sequence[bytes], hit: int, end: int) -> int:
        """The prefix length once in-flight reads land, if it grows past ``hit`` (else 0):
        positions from ``hit`` on are each held by every namespace in L1 or in flight, and
        some are in flight. Answering LOADING until the whole continuation is in L1 (rather
        than READY with the part that landed first) lets the engine load it in one go."""
        index, inflight = self.tier.index, self.inflight
        waiting = False
        for k in range(hit, end):
            h = hashes[k]
            for ns in nss:
                if index.get(ns, h) is None:
                    if (ns.id, h) not in inflight:
                        return k if waiting else 0
                    waiting = True
        return end if waiting else 0

    def _hdr(self) -> bytearray:
        return self._hdrs.pop() if self._hdrs else aligned_buffer(BLOCK)

    def _read(self, run: list[_Rec], done: Callable[[list[_Rec], list[str], list[int]], None],
              verify: bool = True) -> IoOp:
        """One readv for records adjacent on disk; checked on the engine thread (headers, and
        with ``verify`` the payload checksums), then ``done(run, outcomes, checksums)`` on the loop."""
        t = self.tier
        view = t.pool_view
        bufs: list[memoryview | bytearray] = []
        for r in run:
            bufs.append(r.hdr)
            bufs.append(view[r.block.offset:r.block.offset + round_up(r.block.size)])
        total = sum(len(x) for x in bufs)
        clock = IoClock(t.metrics.read_io_throughput)

        def complete(res: int) -> None:
            # engine thread: verify before the loop may publish the pages
            if res != total:
                t.call_soon(done, run, ["io_error"] * len(run), [0] * len(run))
                return
            clock.done(total)  # the I/O's time, before the checks
            out: list[str] = []
            sums: list[int] = []
            for r in run:
                b, e = r.block, r.entry
                h = unpack_header(r.hdr)
                ok = (h is not None and h.hash == b.hash and h.ns_name == b.ns.name and h.gen == e.gen
                      and h.seq == e.seq and h.payload_len == b.size
                      and (not verify or checksum(view[b.offset:b.offset + b.size]) == h.payload_csum))
                out.append("ok" if ok else "checksum")
                sums.append(h.payload_csum if ok and h is not None else 0)
            t.call_soon(done, run, out, sums)

        return IoOp(False, t.store.files[run[0].entry.file].fd, run[0].entry.offset, bufs, complete, clock.issued)

    def _done(self, batch: _Batch, run: list[_Rec], outcomes: list[str], sums: list[int]) -> None:
        t = self.tier
        m = t.metrics
        good = [r for r, o in zip(run, outcomes, strict=True) if o == "ok"]
        waiters, self._waiters = self._waiters, []
        for r in run:
            self.inflight.pop(r.key, None)
            self._hdrs.append(r.hdr)
        if good:
            keys = [r.key for r in good]
            t.promoting.update(keys)
            try:
                committed = t.index.commit([r.block for r in good])
            finally:
                t.promoting.difference_update(keys)
            t.index.pin(committed)
            batch.pinned.extend(committed)
            if t.checksums is not None and committed:
                # The payload checksum verified above is the pool's page checksum: a peer
                # pulling this page gets it without the page being hashed again to send it.
                verified = {id(r.block): c for r, o, c in zip(run, outcomes, sums, strict=True) if o == "ok"}
                for b in committed:
                    t.checksums.record(b, verified[id(b)])
            m.promoted.inc(len(good))
            m.read_bytes.inc(sum(r.block.size for r in good))
        for r, o in zip(run, outcomes, strict=True):
            if o != "ok":
                self._failed(r, o)
        batch.remaining -= len(run)
        if batch.remaining == 0:
            m.promote_latency.observe(time.perf_counter() - batch.t0)
            assert t.loop is not None
            batch.timer = t.loop.call_later(HOLD_SECONDS, self._unpin, batch)
            for b in batch.pinned:
                self._holding.setdefault(id(b), []).append(batch)
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def _failed(self, r: _Rec, outcome: str) -> None:
        """A record that did not read back as written: its page is freed and its SSD entry
        dropped (a corrupt or unreadable record is a miss from now on, never served)."""
        t = self.tier
        t.index.discard((r.block,))
        if t.store.get(r.key) is r.entry:
            t.store.remove(r.key)
            t.on_ssd_evicted([r.key], dropped=True)  # watchers and the cluster index: gone
        if outcome == "checksum":
            t.metrics.checksum_failures.inc()
            t.log_checksum_failure(r.entry)
        else:
            t.metrics.read_errors.inc()
            t.log_io_error("read", 1)

    async def stage(self, ns: Namespace, hashes: Sequence[bytes], timeout: float) -> list[tuple[Block, int]]:
        """Read the leading ``hashes`` that are on SSD only into PENDING pool pages for a
        peer's pin (pegaflow/node/tiers/remote/pins.py), without promoting them.

        Returns the leading blocks that read back with the header their index entry expects,
        each with its record's payload checksum, which is *not* verified here: the puller
        verifies every page it receives against it (a corrupt record is then a miss there,
        and a checksum failure of this peer), so the page is hashed once, not twice, and
        never becomes visible here. The caller owns the returned pages and discards them
        (``BlockIndex.discard``) when the transfer is done. Reads count against
        ``--max-prefetch-blocks`` and wait for the read gate like promotions, for at most
        ``timeout`` seconds; a stage cancelled meanwhile frees its pages as their reads land.
        While staged, a block's key is PENDING here: a local Query neither finds nor
        promotes it until the pin ends (the engine recomputes, as for any block on its way).
        """
        t = self.tier
        index, store = t.index, t.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def first_on_ssd_only() -> bool:
            key = (ns.id, hashes[0])
            return key in store.entries and key not in self.inflight and index.get(ns, hashes[0]) is None

        if not hashes or not first_on_ssd_only():
            return []  # nothing to read: never wait for read slots
        while self._room() == 0 or t.reads.full():
            if loop.time() >= deadline:
                return []
            await _until(self.landed(), deadline - loop.time())
        room = self._room()
        need: list[bytes] = []
        for h in hashes[:room]:
            key = (ns.id, h)
            if key not in store.entries or key in self.inflight or index.get(ns, h) is not None:
                break
            need.append(h)
        if not need:
            return []
        blocks = index.reserve(ns, need)
        # The run ends at the first hash reserve gave no page: one in the table already (in
        # any state: another pin staged it) or no room. The caller takes the result as the
        # blocks of ``hashes[:len(result)]``, position by position: a block past a gap would
        # be served as another hash's page, under its own (matching) checksum.
        k = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
        index.discard([b for b in blocks[k:] if b is not None])
        recs = [_Rec((ns.id, h), b, store.entries[(ns.id, h)], self._hdr())
                for h, b in zip(need[:k], cast("list[Block]", blocks[:k]), strict=True)]
        if not recs:
            return []
        state = _Stage(loop.create_future(), len(recs))
        self.staging += len(recs)
        t.reads.offer([self._read(run, functools.partial(self._staged, state), verify=False) for run in _runs(recs)])
        try:
            await asyncio.shield(state.fut)
        except BaseException:
            state.abandoned = True
            for b, _ in state.out.values():
                index.discard((b,))
            state.out.clear()
            raise
        got: list[tuple[Block, int]] = []
        for r in recs:  # the leading run that landed; a failed record ends the prefix
            x = state.out.get(r.key)
            if x is None:
                break
            got.append(x)
        kept = {id(b) for b, _ in got}
        index.discard([b for b, _ in state.out.values() if id(b) not in kept])
        return got

    def _staged(self, state: _Stage, run: list[_Rec], outcomes: list[str], sums: list[int]) -> None:
        t = self.tier
        nbytes = 0
        for r, o, c in zip(run, outcomes, sums, strict=True):
            self._hdrs.append(r.hdr)
            if o != "ok":
                self._failed(r, o)
            elif state.abandoned:
                t.index.discard((r.block,))
            else:
                state.out[r.key] = (r.block, c)
                nbytes += r.block.size
        t.metrics.read_bytes.inc(nbytes)
        self.staging -= len(run)
        state.remaining -= len(run)
        if state.remaining == 0 and not state.fut.done():
            state.fut.set_result(None)
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def leased(self, blocks: Sequence[Block]) -> None:
        """A Query leased ``blocks``: end the holds of completed batches it covers entirely."""
        if not self._holding:
            return
        ids = {id(b) for b in blocks}
        done = {id(x): x for i in ids for x in self._holding.get(i, ())}
        for batch in done.values():
            if all(id(b) in ids for b in batch.pinned):
                self._unpin(batch)

    def _unpin(self, batch: _Batch) -> None:
        if batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        for b in batch.pinned:
            held = self._holding.get(id(b))
            if held is not None:
                try:
                    held.remove(batch)
                except ValueError:
                    pass
                if not held:
                    del self._holding[id(b)]
        self.tier.index.unpin(batch.pinned)
        batch.pinned = []
