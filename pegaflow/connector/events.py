"""vLLM KV cache events for what this engine stored in PegaFlow, and what PegaFlow lost.

With vLLM's ``kv_events_config`` (``enable_kv_cache_events``), vLLM publishes the events of
its own GPU/CPU block pool (ZMQ publisher) for KV-aware routers; the scheduler also asks
the connector (``take_events``) every step. This module answers with:

* ``BlockStored`` (medium ``CPU``: the node's shared-memory pool) for the blocks this
  engine saved, once the node committed them;
* ``BlockRemoved`` (``CPU``) when the node evicts or resets them, and ``BlockStored`` /
  ``BlockRemoved`` (medium ``STORAGE``) when its SSD tier writes them or reuses their space.

The node sends the last two on the engine's Session stream (``pegaflow.node.block_events``);
they arrive on the client's session thread, queue here, and become events in ``take``.
Block hashes are vLLM's own (``request.block_hashes``, as in vLLM's GPU events, converted by
``maybe_convert_block_hash``: 64-bit ints unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``),
so a router sees one block under one name in every medium; PegaFlow's hash, converted
the same way, is used where vLLM computed none. An engine remembers the last
``MAX_ANNOUNCED`` blocks it stored (their tokens, for the SSD ``BlockStored``); events for
older ones are not sent. TP: a block counts as stored once shard 0's page is committed.
"""

from __future__ import annotations

import collections
import logging
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from pegaflow.client import BlockEvents
from pegaflow.connector.link import LOGGER_NAME

if TYPE_CHECKING:  # vLLM is imported where an event is made (the module loads without it)
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent
    from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash
    from vllm.v1.request import Request

logger = logging.getLogger(LOGGER_NAME)

MAX_ANNOUNCED = 1 << 16  # blocks remembered per engine (~0.5 KiB each at 128-token blocks)
MEDIUM_OF = {"dram": "CPU", "ssd": "STORAGE"}  # vLLM's MEDIUM_CPU / MEDIUM_STORAGE


@dataclass(frozen=True)
class _Announced:
    block_hash: ExternalBlockHash  # vLLM's external block hash
    parent: ExternalBlockHash | None
    tokens: array[int]  # uint32 token ids of the block
    lora_name: str | None


class KVEvents:
    def __init__(self, namespace: str, block_size: int) -> None:
        self.namespace = namespace  # shard 0's: its pages stand for the block
        self.block_size = block_size
        self._announced: collections.OrderedDict[bytes, _Announced] = collections.OrderedDict()
        self._node: collections.deque[tuple[list[BlockEvents], int]] = collections.deque()
        self._out: list[KVCacheEvent] = []
        self._lock = threading.Lock()  # _node is appended from the session thread
        self._warned_dropped = False

    # ---- inputs -------------------------------------------------------------------------
    def stored(self, request: Request, blocks: Sequence[tuple[int, bytes]], chain: Sequence[bytes]) -> None:
        """Blocks of ``request`` (index in the request, PegaFlow hash) were committed;
        ``chain``: the request's PegaFlow hashes (for a parent where vLLM has none)."""
        vhashes = getattr(request, "block_hashes", None) or []
        tokens = request.all_token_ids
        lora = getattr(request, "lora_request", None)
        lora_name = getattr(lora, "lora_name", None) if lora is not None else None
        bs = self.block_size
        batch, parent0 = [], None
        for k, (i, h) in enumerate(blocks):
            bh = self._external(vhashes[i] if i < len(vhashes) else h)
            parent = None
            if i > 0:
                parent = self._external(vhashes[i - 1] if i - 1 < len(vhashes) else chain[i - 1])
            if k == 0:
                parent0 = parent
            a = _Announced(bh, parent, array("I", tokens[i * bs:(i + 1) * bs]), lora_name)
            self._remember(h, a)
            batch.append(a)
        contiguous = all(b[0] == blocks[0][0] + k for k, b in enumerate(blocks))
        if batch and contiguous:  # one event for a chain, as vLLM's block pool sends
            self._out.append(self._stored_event(batch, parent0, MEDIUM_OF["dram"]))
        else:
            self._out.extend(self._stored_event([a], a.parent, MEDIUM_OF["dram"]) for a in batch)

    def on_blocks(self, events: list[BlockEvents], dropped: int) -> None:
        """``PegaClient(on_blocks=...)``: called from the session thread."""
        with self._lock:
            self._node.append((events, dropped))

    # ---- output -------------------------------------------------------------------------
    def take(self) -> list[KVCacheEvent]:
        from vllm.distributed.kv_events import BlockRemoved

        with self._lock:
            node, self._node = self._node, collections.deque()
        out, self._out = self._out, []
        for events, dropped in node:
            if dropped and not self._warned_dropped:
                logger.warning("PegaFlow: %d block events were dropped by the node (read too slowly); "
                               "a KV-event consumer may believe PegaFlow holds blocks it lost", dropped)
                self._warned_dropped = True
            for e in events:
                if e.namespace != self.namespace:
                    continue
                known = [(h, self._announced[h]) for h in e.hashes if h in self._announced]
                if not known:
                    continue
                medium = MEDIUM_OF.get(e.medium)
                if not e.stored:
                    out.append(BlockRemoved(block_hashes=[a.block_hash for _, a in known], medium=medium))
                    if e.medium == "ssd":  # gone from the SSD too (or reset): forget it
                        for h, _ in known:
                            self._announced.pop(h, None)
                    continue
                # SSD writes: one event per block (they need not form a chain)
                out.extend(self._stored_event([a], a.parent, medium) for _, a in known)
        return out

    # ---- internals ----------------------------------------------------------------------
    def _stored_event(self, chain: list[_Announced], parent: ExternalBlockHash | None, medium: str | None) -> BlockStored:
        """One ``BlockStored`` for consecutive blocks ``chain`` (its first block's parent: ``parent``)."""
        from vllm.distributed.kv_events import BlockStored

        return BlockStored(
            block_hashes=[a.block_hash for a in chain], parent_block_hash=parent,
            token_ids=[t for a in chain for t in a.tokens], block_size=self.block_size, lora_id=None,
            medium=medium, lora_name=chain[0].lora_name,
        )

    def _remember(self, h: bytes, a: _Announced) -> None:
        ann = self._announced
        ann[h] = a
        ann.move_to_end(h)
        while len(ann) > MAX_ANNOUNCED:
            ann.popitem(last=False)

    @staticmethod
    def _external(block_hash: bytes) -> ExternalBlockHash:
        """vLLM's own hash (a ``BlockHash``) or PegaFlow's, as vLLM's events name blocks."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return maybe_convert_block_hash(cast("BlockHash", block_hash))
