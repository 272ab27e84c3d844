"""Write-behind: every block committed into L1 is copied to SSD once, without ever
blocking a save.

Contracts:
- Called from the block index's ``insert`` listener (the node's event loop). A block is
  queued only if it fits the bounded queue (``--ssd-write-queue-size`` bytes); otherwise
  the write is skipped and counted. The blocks one insert adds are one batch for the
  write gate (``gate.py``): when ``--ssd-write-queue-depth`` batches already wait for a
  free write slot (``--ssd-write-inflight`` I/Os in flight), the whole batch is skipped
  (``queue_full``), as the original drops a batch offered to its full write channel.
  Nothing here waits.
- A queued block is **pinned** in L1 until its write completed: the kernel reads the
  page straight from the pool (O_DIRECT), so the page must not be evicted and reused
  meanwhile, else another block's bytes would reach disk under this block's checksum.
  The checksum is computed on the engine thread from the pinned page, right before
  the write is issued.
- A block is indexed on SSD only after its write completed and its segment was not
  reclaimed meanwhile.
- A reset of a block's namespace (``SsdTier.clear``) voids its queued write: one not issued
  yet is dropped, never written (its slot would be numbered after the reset record, and a
  restarted node's scan would index it again); one issued already lies before the reset
  record, which voids it on disk, and is not indexed when it lands.
- Blocks already on SSD are not written again, except promoted blocks whose copy is
  about to be reclaimed (older than ``SECOND_CHANCE_AGE`` of the log): they go back to
  the head, which turns FIFO into FIFO-with-reinsertion for blocks that are really reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from pegaflow.core.block_index import Block, IndexEvent, Namespace
from pegaflow.node.tiers.ssd.metrics import IoClock
from pegaflow.node.tiers.ssd.parts import TierParts
from pegaflow.node.tiers.ssd.records import BLOCK, aligned_buffer, checksum, pack_header, round_up
from pegaflow.node.tiers.ssd.store import Slot
from pegaflow.node.tiers.ssd.uring import MAX_IOV, IoOp

WRITE_COALESCE_BYTES = 4 << 20  # adjacent records go out in one writev up to this size
SECOND_CHANCE_AGE = 0.75  # re-write a promoted block whose SSD copy is older than this


@dataclass(slots=True, eq=False)
class _Rec:
    block: Block
    slot: Slot
    hdr: bytearray
    name: bytes


class WriteBehind:
    def __init__(self, tier: TierParts, limit_bytes: int) -> None:
        self.tier = tier
        self.limit_bytes = limit_bytes
        self.pending: set[tuple[int, bytes]] = set()
        self.voided: set[tuple[int, bytes]] = set()  # pending when their namespace was cleared
        self.queued_bytes = 0
        self.writing = 0  # blocks whose write was issued and whose completion is not handled yet
        self.closing = False
        self._hdrs: list[bytearray] = []
        self._scheduled = 0  # batches accepted whose _issue has not run yet (they count as waiting)

    def on_index_event(self, op: IndexEvent, ns: Namespace, hashes: list[bytes]) -> None:
        """Block-index listener: queue newly committed blocks for SSD."""
        if op is not IndexEvent.INSERT or self.closing:
            return
        t = self.tier
        store, index, m = t.store, t.index, t.metrics
        size = round_up(ns.page_bytes)
        if t.writes.waiting() + self._scheduled >= t.writes.queue_depth:
            m.skipped.labels("queue_full").inc(sum(1 for h in hashes if (ns.id, h) not in self.pending))
            return
        batch: list[Block] = []
        for h in hashes:
            key = (ns.id, h)
            if key in self.pending:
                continue
            e = store.get(key)
            if e is not None and not (key in t.promoting and store.age(e) >= SECOND_CHANCE_AGE):
                continue
            if BLOCK + size > store.max_record:
                m.skipped.labels("too_large").inc()
                continue
            if self.queued_bytes + size > self.limit_bytes:
                m.skipped.labels("queue_full").inc()
                continue
            b = index.get(ns, h)
            if b is None:
                continue
            index.pin((b,))
            self.pending.add(key)
            self.queued_bytes += size
            batch.append(b)
        if batch:
            # Not inline: this runs inside a Commit. Issued once the data path pauses
            # (pegaflow/node/idle.py): the I/O thread's per-block Python then does not
            # compete for the GIL with the engine's next calls.
            self._scheduled += 1
            t.defer(self._issue, batch)

    # ---- issue ------------------------------------------------------------------------
    def _issue(self, blocks: list[Block]) -> None:
        t = self.tier
        self._scheduled -= 1
        if self.voided:
            # Reset before it went out: never written. A slot taken now would be numbered
            # after the reset record, so a restarted node's scan would index it again.
            self._forget([b for b in blocks if b.key in self.voided])
            blocks = [b for b in blocks if b.key in self.pending]
        runs: list[list[_Rec]] = []
        run_bytes = 0
        for b in blocks:
            slot, evicted = t.store.allocate(b.size)
            if evicted:
                t.on_ssd_evicted(evicted)
            rec = _Rec(b, slot, self._hdr(), b.ns.name.encode())
            size = BLOCK + round_up(b.size)
            last = runs[-1][-1] if runs else None
            if (last is not None and last.slot.file == slot.file and last.slot.segment == slot.segment
                    and last.slot.offset + BLOCK + round_up(last.block.size) == slot.offset
                    and run_bytes + size <= WRITE_COALESCE_BYTES and 2 * len(runs[-1]) + 2 <= MAX_IOV):
                runs[-1].append(rec)
                run_bytes += size
            else:
                runs.append([rec])
                run_bytes = size
        if not runs:
            return
        self.writing += len(blocks)
        ops = [self._op(run) for run in runs]
        accepted = t.writes.offer(ops)
        assert accepted, "checked in on_index_event: at most queue_depth batches wait"

    def _op(self, run: list[_Rec]) -> IoOp:
        t = self.tier
        view = t.pool_view
        bufs: list[memoryview | bytearray] = []
        for r in run:
            b = r.block
            bufs.append(r.hdr)
            bufs.append(view[b.offset:b.offset + round_up(b.size)])
        total = sum(len(x) for x in bufs)

        known = t.checksums
        clock = IoClock(t.metrics.write_io_throughput)

        def prepare() -> None:
            for r in run:
                b = r.block
                # The page is pinned, so a value the node's p2p checksums hold describes it;
                # otherwise it is hashed here and shared with them.
                c = known.get(b) if known is not None else None
                if c is None:
                    c = checksum(view[b.offset:b.offset + b.size])
                    if known is not None:
                        known.record(b, c)
                pack_header(r.hdr, r.slot.gen, r.slot.seq, r.name, b.hash, b.size, c)
            clock.issued()  # after the checksums: the I/O's own time

        def complete(res: int) -> None:
            if res == total:
                clock.done(total)
            # The bookkeeping (unpin, index the records, SSD insert events) waits for a
            # pause of the data path too: it is per-block Python on the node's loop.
            t.call_soon(t.defer, self._done, run, res == total)

        return IoOp(True, t.store.files[run[0].slot.file].fd, run[0].slot.offset, bufs, complete, prepare)

    def _hdr(self) -> bytearray:
        return self._hdrs.pop() if self._hdrs else aligned_buffer(BLOCK)

    # ---- completion (event loop) ------------------------------------------------------
    def _forget(self, blocks: list[Block]) -> None:
        """Unqueue blocks whose namespace was cleared before their write was issued."""
        self.tier.index.unpin(blocks)
        for b in blocks:
            self.pending.discard(b.key)
            self.voided.discard(b.key)
            self.queued_bytes -= round_up(b.size)

    def _done(self, run: list[_Rec], ok: bool) -> None:
        t = self.tier
        m = t.metrics
        blocks = [r.block for r in run]
        t.index.unpin(blocks)
        self.writing -= len(blocks)
        stored: dict[int, tuple[Namespace, list[bytes]]] = {}  # namespace id -> (namespace, hashes written)
        for r in run:
            b = r.block
            key = b.key
            self.pending.discard(key)
            self.queued_bytes -= round_up(b.size)
            self._hdrs.append(r.hdr)
            if key in self.voided:  # cleared while it was written (its slot before the reset record): not indexed
                self.voided.discard(key)
            elif not ok:
                m.skipped.labels("io_error").inc()
            elif t.store.add(key, r.slot, b.ns.name, b.size):
                m.written.inc()
                m.write_bytes.inc(b.size)
                stored.setdefault(b.ns.id, (b.ns, []))[1].append(b.hash)
        for ns, hs in stored.values():
            t.ssd_stored(ns, hs)
        if not ok:
            t.log_io_error("write", len(run))

    def idle(self) -> bool:
        return not self.pending

