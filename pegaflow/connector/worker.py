"""Worker side of PegaKVConnector: copies between one rank's paged KV cache and pool pages.

A worker never talks to the node except to register (which maps the pool). Per step:

* ``start_load`` copies every ``LoadIntent`` of the step (one batched ``load_pages`` call)
  before the forward. If the pool is not mapped, or is mapped from another epoch of the
  rank's node than the one the offsets were issued under, nothing is copied and the blocks
  are reported through ``get_block_ids_with_load_errors`` so vLLM recomputes them: never
  wrong KV.
* ``save`` copies this rank's shard of every ``SaveIntent`` after the forward (one batched
  ``save_pages`` call) if this rank is the one that writes its shard on its node (MLA: rank
  0 only, or the first rank of each node with TP ranks on several nodes: ``placement.py``).
  Failed copies are reported as failed reservations; the scheduler aborts them.
* ``report`` tells the scheduler which step was handled, and what the copies that completed
  since the last report took (``CopyTimes``: one duration per save or load batch, i.e. per
  rank and step, and the load batches that failed), which the scheduler side passes on to
  the node with its next Commit or Release (the node's ``pegaflow_node_save_copy_seconds``
  and ``pegaflow_node_load_copy_seconds``; the original's ``pegaflow_save_duration_seconds``
  and ``pegaflow_load_duration_seconds``). On a CPU a batch's time is its copy call's; on a
  GPU, from issuing it until ``report`` finds its step's events completed (so up to a step
  more than the DMA itself).
* ``take_finished_recving`` (vLLM's ``get_finished``): the requests whose asynchronous
  load this rank copied (or failed to copy) in the step's ``start_load``;
  ``take_failed_recving``: those of them that failed as a whole. With several KV cache
  groups every failure is reported so (vLLM maps no block id back to a request then); with
  one, failed blocks are load errors and vLLM recomputes from the first of them.

Copies go through ``pegaflow.client``: native on CPU; on a GPU through the rank's
``DeviceCopier`` (staging, index and bounce buffers allocated once at
``register_kv_caches``; ``pegaflow/client/batched.py``), issued on the copy stream
(``inflight.py``), from pool memory a background thread registers with CUDA
(``PoolPins``, started for every pool mapping the worker copies to; pieces not registered
yet go through the copier's pinned bounce slots).

A worker that cannot copy (a layout it cannot page, a page size the scheduler does not
expect, a physical layout other than the one the namespace names, no staging memory) is
**disabled**, says why once, and tells the scheduler side: at start through vLLM's
handshake metadata (``handshake``, before any request is scheduled) and with every report
(``PegaWorkerReport.disabled``); the scheduler then stops promising loads and planning
saves, so no request waits on, or counts, a copy that cannot happen.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pegaflow.client.batched import (
    ALL_PINNED,
    DEFAULT_STAGING_BYTES,
    DeviceCopier,
    DeviceStream,
    Event,
    Issued,
    IssueFailed,
    Pins,
)
from pegaflow.client.blocks import BlockIds
from pegaflow.client.client import CopyTimes
from pegaflow.common.validate import MAX_COPY_TIMES
from pegaflow.connector.inflight import CopyStream, Immediate, InFlight
from pegaflow.connector.intents import (
    LoadIntent,
    PageBlock,
    PegaConnectorMetadata,
    PegaWorkerReport,
    PegaWorkerState,
)
from pegaflow.connector.layout import PageLayout, build_page_layout
from pegaflow.connector.link import LOGGER_NAME, NodeLink
from pegaflow.connector.placement import Placement
from pegaflow.core.identity import KVIdentity

logger = logging.getLogger(LOGGER_NAME)


# save_pages / load_pages: (segments, block ids, pool, offsets, segment groups) -> bytes copied
CopyPages = Callable[[Sequence[torch.Tensor], BlockIds, torch.Tensor, Sequence[int], Sequence[int] | None], int]
DeviceProperties = Any  # torch.cuda's _CudaDeviceProperties: torch's stubs name no PCI fields (old torches have none)


def _copy_fns() -> tuple[CopyPages, CopyPages]:
    from pegaflow.client import load_pages, save_pages

    return load_pages, save_pages


# (pool, front) -> the pool's registration: ``front()`` is how far the node has pre-faulted it.
PinsFactory = Callable[[torch.Tensor, Callable[[], int]], Pins]


def stream_for(device: torch.device) -> CopyStream:
    """The copy stream for a KV cache on ``device``: a CUDA side stream, or ``Immediate``."""
    if device.type == "cuda":
        from pegaflow.client.cuda import CudaCopyStream

        return CudaCopyStream(device)
    return Immediate()


def pins_for(device: torch.device) -> PinsFactory:
    """How pool memory is registered for DMA from ``device``: CUDA's registration, started in
    the background; elsewhere the pool is usable as it is."""
    if device.type == "cuda":
        from pegaflow.client import cuda

        index = device.index if device.index is not None else torch.cuda.current_device()
        return lambda pool, front: cuda.pins_for(pool, front, device=index)
    return lambda pool, front: ALL_PINNED


def _split_for(device: torch.device) -> int | None:
    """Where the pool's registration pieces end (no DMA spans two), on ``device``."""
    if device.type == "cuda":
        from pegaflow.client.cuda import CHUNK

        return CHUNK
    return None


def _bounce_counter(device: torch.device) -> Callable[[int], None] | None:
    if device.type == "cuda":
        from pegaflow.client.cuda import pin_metrics

        return pin_metrics().bounced.inc
    return None


def pci_bus_id(device: torch.device, properties: Callable[[torch.device], DeviceProperties] | None = None) -> str:
    """The PCI address of a CUDA ``device`` as sysfs names it (``0000:3b:00.0``), sent at
    Register so the node hands this rank pages from its GPU's NUMA node; "" for any other
    device (a CPU engine has no GPU) or a torch that does not say. ``properties``: the
    device's properties (default ``torch.cuda.get_device_properties``), whose PCI domain, bus
    and device numbers make the address, function 0, as ``torch.numa`` reads them."""
    if device.type != "cuda":
        return ""
    try:
        p: DeviceProperties = (properties or torch.cuda.get_device_properties)(device)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        logger.info("PegaFlow: no PCI address for %s (%s); the node places this rank's pages by its CPUs",
                    device, exc)
        return ""


class WorkerSide:
    """One TP rank's copy engine; see the module docstring for the contract.

    ``link_factory(pages, pci_bus_id)`` registers this rank's namespaces (``pages``: namespace
    -> page bytes) with its node (with TP ranks on several nodes, its group's: ``placement``),
    telling it the PCI address of the rank's GPU ("" on CPU). The rank copies its own place
    only: ``offsets[place]`` of a load, checked against ``epochs[place]``, and the saves of its
    place if it is the one rank that writes it.
    ``stream`` and ``pins`` are the hardware edge (default: the KV cache's device's, chosen
    at ``register_kv_caches``); ``staging_bytes`` sizes each copier's device staging."""

    def __init__(self, identity: KVIdentity, tp_rank: int, link_factory: Callable[[dict[str, int], str], NodeLink],
                 kv_groups: int = 1,
                 state_groups: frozenset[int] = frozenset(), stream: CopyStream | None = None,
                 pins: PinsFactory | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 placement: Placement | None = None) -> None:
        self.identity = identity
        self.kv_groups = kv_groups  # vLLM's KV cache groups (hybrid allocator: > 1)
        self.state_groups = state_groups  # of those, state-space (Mamba) groups: state pages
        self.tp_rank = tp_rank
        self.shard = identity.shard_of_rank(tp_rank)
        placement = placement or Placement.of(identity)
        self.place = placement.place_of_rank(tp_rank)  # with one node, the shard
        self.saves_shard = placement.writes(tp_rank)
        self.namespace = identity.namespace(self.shard)
        self.state_namespace = identity.state_namespaces[self.shard] if identity.state_page_bytes else ""
        self._link_factory = link_factory
        self.link: NodeLink | None = None
        self.layout: PageLayout | None = None
        self.state_layout: PageLayout | None = None  # state-space layers' state pages
        self._load_errors: set[int] = set()
        self._finished_recving: set[str] = set()  # asynchronous loads done (copied or failed)
        self._failed_recving: set[str] = set()  # of those, the ones that failed (several KV cache groups)
        self._failed_reservations: set[int] = set()
        # The last step whose saves may hold KV computed over a failed synchronous load (see save()).
        self._poisoned_through = -1
        # Saves copied into the pool by a bounce slot's finisher: (step, its completion, the
        # reservations it writes); a completion with an ``error`` fails them.
        self._bounced: list[tuple[int, Event, frozenset[int]]] = []
        # A step whose saves are not issued yet (bound, ``save`` not called): with speculative
        # decoding vLLM asks for the report before ``wait_for_save``, and the step must not
        # be reported done before its copies even started.
        self._save_pending: int | None = None
        self._load_pages, self._save_pages = _copy_fns()
        # The copy stream (inflight.py): None until register_kv_caches sees the cache's device.
        self.stream: CopyStream | None = stream
        self._pins_factory = pins
        self.staging_bytes = staging_bytes
        self.copier: DeviceCopier | None = None  # asynchronous copies (a GPU): made at register
        self.state_copier: DeviceCopier | None = None
        self._pool: torch.Tensor | None = None  # the mapping the last copies used
        self._pins: Pins = ALL_PINNED  # its registration
        self.disabled: str | None = None  # why this rank does not copy (None: it does)
        self.inflight = InFlight()
        self._lost: set[int] = set()
        self._layer_events: dict[str, Event] = {}  # this step's synchronous loads, per layer
        self._band_events: list[Event] = []  # the events behind _layer_events (recycled next step)
        self._layerwise = True  # the layout's layer names are the ones vLLM waits for
        self._load_event: Event | None = None  # after the newest asynchronous load issued
        # Counters by name, and the original's per-batch observations (OP_LISTS) as lists:
        # sent to the scheduler's process as KVConnectorStats data (PegaConnectorStats).
        self.stats: dict[str, float | list[float]] = {}
        self._saving: dict[int, set[str]] = {}  # step -> requests whose saves are on the copy stream
        self._saving_reported = 0
        self._warned: set[str] = set()
        # Copy times for the next report: batches done (seconds), batches issued on a copy
        # stream and not known done yet (step, is a save, issued at), load batches that failed.
        self._save_s: list[float] = []
        self._load_s: list[float] = []
        # (step, is a save, issued at, its blocks)
        # Issued batches until their step is done: (step, is save, issued at, blocks, a save's reservations)
        self._timing: list[tuple[int, bool, float, int, frozenset[int]]] = []
        self._load_failures = 0

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def disable(self, reason: str) -> None:
        """This rank copies nothing from now on; the scheduler side learns it (``handshake``,
        ``report``) and stops planning copies."""
        if self.disabled is None:
            logger.error("PegaFlow disabled on rank %d: %s", self.tp_rank, reason)
        self.disabled = reason
        self.layout = self.state_layout = None

    def handshake(self) -> PegaWorkerState:
        """What the scheduler side must know before it schedules anything (vLLM collects it
        from every rank after ``register_kv_caches``)."""
        return PegaWorkerState(rank=self.tp_rank, disabled=self.disabled or "",
                               node=self.link.node_id if self.link is not None else "")

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None,
                           layer_groups: Mapping[str, int] | None = None, layerwise: bool = True) -> None:
        """``layerwise=False``: the cache is not keyed by the layers' names (one cross-layer
        tensor): a load is waited for as a whole before the forward."""
        t0 = time.perf_counter()
        self._layerwise = layerwise
        state_layout = None
        try:
            if self.state_groups and layer_groups:
                attn = {n: g for n, g in layer_groups.items() if g not in self.state_groups}
                states = {n: g for n, g in layer_groups.items() if g in self.state_groups}
                layout = build_page_layout(kv_caches, num_blocks, attn, num_groups=self.kv_groups)
                state_layout = build_page_layout(kv_caches, num_blocks, states, num_groups=self.kv_groups)
            else:
                layout = build_page_layout(kv_caches, num_blocks, layer_groups)
        except ValueError as exc:
            self.disable(f"the KV cache cannot be paged: {exc}")
            return
        want = (self.identity.page_bytes, self.identity.state_page_bytes)
        got = (layout.page_bytes, state_layout.page_bytes if state_layout is not None else 0)
        if got != want:
            self.disable(f"KV cache page (and state page) are {got} bytes, the scheduler expects {want}")
            return
        device = layout.segments[0].device
        if device.type not in ("cpu", "cuda"):  # an XPU, HPU, ...: every load and save would fail
            self.disable(f"no copy path for a KV cache on {device.type} (PegaFlow copies CPU and CUDA caches)")
            return
        if self.stream is None:
            try:
                self.stream = stream_for(device)
            except (RuntimeError, OSError) as exc:  # no CUDA runtime to load (a ROCm torch's "cuda")
                self.disable(f"no copy stream for the KV cache on {device}: {exc}")
                return
        if self._pins_factory is None:
            self._pins_factory = pins_for(device)
        self.inflight.recycle = self.stream.recycle
        if self.stream.asynchronous:
            try:
                self.copier = self._copier(layout)
                self.state_copier = self._copier(state_layout) if state_layout is not None else None
            except (RuntimeError, OSError, ValueError) as exc:  # no device memory, no CUDA runtime
                self.disable(f"no copier for the KV cache on {device}: {exc}")
                return
        self.layout = layout
        self.state_layout = state_layout
        pages = {self.namespace: layout.page_bytes}
        if state_layout is not None:
            pages[self.state_namespace] = state_layout.page_bytes
        self.link = self._link_factory(pages, pci_bus_id(layout.segments[0].device))
        # The connector's whole share of the engine's start (layout, register, map the pool);
        # bench/engine_start.py reads it from this line.
        took_ms = (time.perf_counter() - t0) * 1e3
        logger.info(
            "PegaFlow rank %d: %d layers in %d KV cache group(s), %d segments, page %d bytes, namespace %s, node %s, "
            "registered in %.1f ms",
            self.tp_rank,
            len(layout.layer_names),
            layout.num_groups,
            len(layout.segments),
            layout.page_bytes,
            self.namespace,
            "ready" if self.link.ready else "down (will retry)",
            took_ms,
        )
        if self.copier is not None and self.link.ready:
            # Mapped now; registered with CUDA from the first copy on (``_attach``), not now:
            # vLLM captures its CUDA graphs next, and a registration on another thread during
            # a capture (CUDA's global mode) is refused and breaks the capture.
            self._mapped_pool()

    def _copier(self, layout: PageLayout) -> DeviceCopier:
        stream = self.stream
        if not isinstance(stream, DeviceStream):  # an asynchronous stream is a device's: it has DMAs
            raise ValueError(f"the copy stream {type(stream).__name__} queues no DMAs")
        device = layout.segments[0].device
        return DeviceCopier(layout.segments, stream, layout.groups, layout.layers_done_at,
                            staging_bytes=self.staging_bytes, split=_split_for(device), bounce_slots=2,
                            bounce_count=_bounce_counter(device))

    def _mapped_pool(self) -> torch.Tensor | None:
        client = self.link.client if self.link is not None else None
        try:
            return client.pool if client is not None else None
        except Exception:  # noqa: BLE001 - not mapped (yet)
            return None

    def _front(self) -> int:
        """How far the node has pre-faulted its pool (bytes): registration stays behind it."""
        client = self.link.client if self.link is not None else None
        return int(client.health().pool_prefaulted_bytes) if client is not None else 0

    def _attach(self, pool: torch.Tensor | None) -> None:
        """Copies go to ``pool`` from now on: its registration is started (once per mapping)."""
        if pool is None or pool is self._pool or self._pins_factory is None:
            return
        self._pool = pool
        self._pins = self._pins_factory(pool, self._front)

    def _pool_for(self, epoch: int) -> torch.Tensor | None:
        """The mapped pool if it belongs to node epoch ``epoch``, else ``None``."""
        link = self.link
        if link is None or self.layout is None or epoch < 0:
            return None
        if not link.ready:
            return None
        client = link.client
        if client is None:
            return None
        if link.epoch != epoch:
            self._warn_once("epoch", "PegaFlow rank %d: pool epoch %s of node %s != scheduler's epoch %s of it; "
                            "re-attaching", self.tp_rank, link.epoch, link.addr, epoch)
            link.reconnect()
            return None
        pool = client.pool_of(epoch)  # None: not mapped (yet), or the link re-registered meanwhile
        if pool is None:
            return None
        self._attach(pool)
        return pool

    def _request_level(self) -> bool:
        return self.kv_groups > 1

    def _fail_loads(self, loads: list[LoadIntent], step: int) -> None:
        """Loads that were not copied: their blocks are load errors, or with several KV cache
        groups their (asynchronous) requests failed. A synchronous one poisons the saves of
        this step and the next (``save``)."""
        if any(not ld.is_async for ld in loads):
            self._poisoned_through = max(self._poisoned_through, step + 1)
        for ld in loads:
            if self._request_level():
                if ld.is_async:
                    self._failed_recving.add(ld.req_id)
                    self._count("load_errors", len(ld.block_ids))
                else:  # the scheduler never sends one (multi-group hits load asynchronously)
                    logger.error("PegaFlow rank %d: synchronous multi-group load of %s failed; its KV is wrong",
                                 self.tp_rank, ld.req_id)
            else:
                self._load_errors.update(ld.block_ids)  # type: ignore[arg-type]  # one KV cache group: each PageBlock an int

    @property
    def _async(self) -> bool:
        return self.stream is not None and self.stream.asynchronous

    def _begin(self, meta: PegaConnectorMetadata) -> None:
        self._lost.update(self.inflight.begin(meta.step))

    def before_step(self, meta: PegaConnectorMetadata) -> None:
        """Before the step's forward is queued (vLLM binds the metadata): the forward starts
        after the asynchronous loads issued in earlier steps, so a block of a request aborted
        while its load was in flight is never reused under a copy still writing it."""
        self._begin(meta)
        if meta.saves and self.saves_shard:
            self._save_pending = meta.step
        ev, self._load_event = self._load_event, None
        if ev is not None and self.stream is not None and not ev.query():
            self.stream.compute_waits(ev)

    def start_load(self, meta: PegaConnectorMetadata, layerwise: bool = True) -> None:
        """The step's loads. Asynchronously (a GPU): queued on the copy stream, each layer's
        event waited for by ``wait_for_layer`` (``layerwise``) or the whole load by the
        compute stream at once (``layerwise=False``: a forward replayed as one CUDA graph)."""
        self._drop_layer_events()
        if not meta.loads:
            return
        self._begin(meta)
        in_flight: set[str] = set()  # asynchronous loads' requests with a copy queued
        is_async = {ld.req_id for ld in meta.loads if ld.is_async}
        layerwise = layerwise and self._layerwise
        for ld in meta.loads:
            if ld.is_async:
                if ld.missing:
                    if self._request_level():
                        self._failed_recving.add(ld.req_id)
                        self._count("load_errors", len(ld.block_ids) + len(ld.missing))
                    else:
                        self._load_errors.update(ld.missing)  # type: ignore[arg-type]  # one KV cache group: each PageBlock an int
                if self.tp_rank == 0 and not ld.state:  # a request, not a copy: counted once, not per rank
                    self._count("async_loads", 1)
        issued = False
        place = self.place
        for state, epoch in sorted({(ld.state, ld.epochs[place]) for ld in meta.loads}):
            # (An intent with no block copies nothing: a load that lost every block, counted
            # above, or a request aborted before its load was issued.)
            loads = [ld for ld in meta.loads if ld.block_ids and ld.epochs[place] == epoch and ld.state == state
                     and ld.req_id not in self._failed_recving]
            if not loads:
                continue
            block_ids = [b for ld in loads for b in ld.block_ids]
            offsets = [o for ld in loads for o in ld.offsets[place]]
            pool = self._pool_for(epoch)
            layout = self.state_layout if state else self.layout
            if pool is None or layout is None:
                self._fail_loads(loads, meta.step)
                self._load_failures += 1
                self._count("load_failure", 1)
                continue
            t0 = time.perf_counter()
            try:
                if self._async:
                    copier = self.state_copier if state else self.copier
                    assert copier is not None
                    issued_now = self._issue_load(copier, block_ids, pool, offsets,
                                                  layerwise and any(not ld.is_async for ld in loads))
                    self._keep(meta.step, pool, issued_now)
                    nbytes = issued_now.nbytes
                    in_flight |= {ld.req_id for ld in loads if ld.is_async}
                    issued = True
                else:
                    nbytes = self._load_pages(layout.segments, block_ids, pool, offsets, layout.groups)
            except Exception as exc:  # noqa: BLE001 - any copy failure means "recompute these blocks"
                logger.exception(
                    "PegaFlow rank %d: load of %d blocks failed; vLLM recomputes them", self.tp_rank, len(block_ids)
                )
                self._after_failed_issue(meta.step, pool, exc)
                self._fail_loads(loads, meta.step)
                self._load_failures += 1
                self._count("load_failure", 1)
                continue
            if self._async:  # queued, not done: timed until report() finds its step done
                self._timing.append((meta.step, False, t0, len(block_ids), frozenset()))
            else:
                took = time.perf_counter() - t0
                self._count("load_s", took)
                self._load_s.append(took)
                self._done("load", took, len(block_ids))
            self._count("loaded_states" if state else "loaded_blocks", len(block_ids))
            self._count("loaded_bytes", nbytes)
            if "first-load" not in self._warned:
                self._warned.add("first-load")
                logger.info("PegaFlow rank %d: first load, %d blocks from the node", self.tp_rank, len(block_ids))
        if issued:  # the step's copies are in ``inflight`` (``_keep``): its leases go once they completed
            stream = self.stream
            assert stream is not None
            if in_flight:
                ev = stream.record()
                self.inflight.add_load(ev, in_flight)
                self._load_event = ev
            if not layerwise:
                done = stream.record()
                stream.compute_waits(done)
                stream.recycle(done)
        # Reported now: the asynchronous loads that failed, or had nothing to copy. Those
        # with a copy queued are reported by take_finished_recving once it completed.
        self._finished_recving |= is_async - in_flight

    def _issue_load(self, copier: DeviceCopier, block_ids: list[PageBlock], pool: torch.Tensor, offsets: list[int],
                    per_layer: bool) -> Issued:
        """Queue a load on the copy stream: after the work queued on the compute stream (the
        blocks written may still be read by it), one event per band of layers for
        ``wait_for_layer`` (``per_layer``)."""
        stream = self.stream
        assert stream is not None

        def layers_written(names: tuple[str, ...]) -> None:
            ev = stream.record()
            self._band_events.append(ev)
            for name in names:
                self._layer_events[name] = ev

        stream.after_compute()
        with stream.issuing():
            return copier.load(block_ids, pool, offsets, self._pins, layers_written if per_layer else None)

    def _keep(self, step: int, pool: torch.Tensor, issued: Issued) -> None:
        """The step's copies hold ``pool`` (and finish with their host-side parts)."""
        for done in issued.completions:
            self.inflight.add(step, done, keep=pool)
        assert self.stream is not None
        self.inflight.add(step, self.stream.record(), keep=pool)

    def _after_failed_issue(self, step: int, pool: torch.Tensor, exc: Exception) -> None:
        """Some copies of a failed batch may be queued already: the compute stream waits for
        them (a recomputed block is never written under a stray load, a block is never
        reused under a gather still reading it), and the step, with the pool, waits until
        they ran, bounce copies into the pool included (``IssueFailed``): the failed saves'
        pages are aborted only then, so none is handed out again while a copy writes it."""
        if not self._async:
            return
        assert self.stream is not None
        ev = self.stream.record()
        self.stream.compute_waits(ev)
        self.inflight.add(step, ev, keep=pool)
        for done in exc.completions if isinstance(exc, IssueFailed) else ():
            self.inflight.add(step, done, keep=pool)

    def _drop_layer_events(self) -> None:
        """Last step's per-layer events: every wait on them is queued by now."""
        if self.stream is not None:
            for ev in self._band_events:
                self.stream.recycle(ev)
        self._band_events.clear()
        self._layer_events.clear()

    def wait_for_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the current stream waits for that layer's load,
        at every call (micro-batches of one step each wait, on their own streams)."""
        ev = self._layer_events.get(layer_name)
        if ev is not None and self.stream is not None:
            self.stream.compute_waits(ev)

    def save(self, meta: PegaConnectorMetadata) -> None:
        """vLLM's ``wait_for_save``, after the forward was queued. First, what is queued next
        (this step's gathers, the next step) waits for all of this step's loads, whether a
        layer waited for its own or not (a layer the forward skipped, a drafter replayed as
        one CUDA graph): the last band's event, recorded after every band's copies."""
        if self._band_events and self.stream is not None:
            self.stream.compute_waits(self._band_events[-1])
        if not meta.saves:
            return
        try:
            if meta.step <= self._poisoned_through:
                self._poisoned(meta)
            elif self.saves_shard:
                self._save(meta)
        finally:
            self._save_pending = None

    def _poisoned(self, meta: PegaConnectorMetadata) -> None:
        """A synchronous load failed in this step or the one before: every save of the step
        fails, every shard's (not only this rank's), so that none is committed. vLLM ran the
        forward before it learnt of the failure: blocks computed in this step attended to the
        KV cache blocks that were not loaded, on this rank, and through the layers' all-reduce
        on every other. The next step too, which vLLM's asynchronous scheduling may have
        planned before it learnt. Such KV stored would be a wrong hit for every engine later."""
        rids = {s.reservation_id for sv in meta.saves for s in sv.shards}
        self._failed_reservations |= rids
        self._count("poisoned_saves", len(rids))
        if self.saves_shard:
            self._count("save_failure", 1)
        self._warn_once("poisoned", "PegaFlow rank %d: a load failed; the saves of the steps that computed over "
                        "it are dropped (their KV would be wrong)", self.tp_rank)

    def _save(self, meta: PegaConnectorMetadata) -> None:
        self._begin(meta)
        mine = [s for sv in meta.saves for s in sv.shards if s.place == self.place]
        owner = {id(s): sv.req_id for sv in meta.saves for s in sv.shards}
        for state, epoch in sorted({(s.state, s.epoch) for s in mine}):
            batch = [s for s in mine if s.epoch == epoch and s.state == state]
            pool = self._pool_for(epoch)
            layout = self.state_layout if state else self.layout
            if pool is None or layout is None:
                self._failed_reservations.update(s.reservation_id for s in batch)
                self._count("save_failure", 1)
                continue
            block_ids = [b for s in batch for b in s.block_ids]
            offsets = [o for s in batch for o in s.offsets]
            t0 = time.perf_counter()
            try:
                if self._async:
                    copier = self.state_copier if state else self.copier
                    assert copier is not None
                    nbytes = self._issue_save(copier, block_ids, pool, offsets, meta.step,
                                              frozenset(s.reservation_id for s in batch))
                else:
                    nbytes = self._save_pages(layout.segments, block_ids, pool, offsets, layout.groups)
            except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an error
                logger.exception("PegaFlow rank %d: save of %d blocks failed", self.tp_rank, len(block_ids))
                self._after_failed_issue(meta.step, pool, exc)
                self._failed_reservations.update(s.reservation_id for s in batch)
                self._count("save_failure", 1)
                continue
            if self._async:
                self._timing.append((meta.step, True, t0, len(block_ids), frozenset(s.reservation_id for s in batch)))
                self._saving.setdefault(meta.step, set()).update(owner[id(s)] for s in batch)
            else:
                took = time.perf_counter() - t0
                self._count("save_s", took)
                self._save_s.append(took)
                self._done("save", took, len(block_ids))
            self._count("saved_states" if state else "saved_blocks", len(block_ids))
            self._count("saved_bytes", nbytes)

    def _issue_save(self, copier: DeviceCopier, block_ids: list[PageBlock], pool: torch.Tensor, offsets: list[int],
                    step: int, reservations: frozenset[int]) -> int:
        """Queue a save on the copy stream after the forward; the compute stream goes on once
        the blocks were read (gathered), the DMA into the pool runs beside the next step, and
        the step is done (its reservations committed) once its event completed."""
        stream = self.stream
        assert stream is not None
        gathered: list[Event] = []
        stream.after_compute()
        with stream.issuing():
            issued = copier.save(block_ids, pool, offsets, self._pins,
                                 on_gathered=lambda: gathered.append(stream.record()))
        for ev in gathered:
            stream.compute_waits(ev)
            stream.recycle(ev)
        self._keep(step, pool, issued)
        for done in issued.completions:  # a bounce copy into the pool: its failure fails these saves
            self._bounced.append((step, done, reservations))
        return issued.nbytes

    def take_finished_recving(self) -> set[str]:
        out, self._finished_recving = self._finished_recving, set()
        return out | self.inflight.finished_loads()

    def take_failed_recving(self) -> set[str]:
        """Failed asynchronous loads, each reported with (not before) its finishing: a
        request with another copy still in flight waits for it."""
        out = self._failed_recving - self.inflight.loading()
        self._failed_recving -= out
        return out

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        if out:
            self._count("load_errors", len(out))
        return out

    def report(self, meta: PegaConnectorMetadata | None) -> PegaWorkerReport | None:
        if meta is None:
            return None
        self._begin(meta)
        if meta.flush:  # the engine goes idle: no forward to overlap, and maybe no step soon
            try:
                self.inflight.drain()
            except Exception as exc:  # noqa: BLE001 - a wait: a copy's failure is reported with its step
                self._warn_once("flush", "PegaFlow rank %d: waiting for the copies in flight failed: %s",
                                self.tp_rank, exc)
        done_through = self.inflight.done_through()
        if self._save_pending is not None:
            done_through = min(done_through, self._save_pending - 1)
        if self._bounced:  # completed (their steps are done): an error is set by now
            settled = [b for b in self._bounced if b[0] <= done_through]
            self._bounced = [b for b in self._bounced if b[0] > done_through]
            for _, done, rids in settled:
                if getattr(done, "error", None) is not None:
                    self._failed_reservations |= rids
                    self._count("save_failure", 1)
        failed, self._failed_reservations = frozenset(self._failed_reservations), set()
        lost, self._lost = frozenset(self._lost), set()
        return PegaWorkerReport(done_through=done_through, failed_reservations=failed,
                                lost_steps=lost, disabled=self.disabled is not None,
                                copies=self._take_copies(done_through, failed))

    def _take_copies(self, done_through: int, failed: frozenset[int] = frozenset()) -> CopyTimes:
        """The copy times to report: the synchronous batches', and those of issued batches
        whose step is done (``done_through``), timed until now; a save batch whose copy into
        the pool failed (its reservations in ``failed``) counted its failure already."""
        if self._timing:
            now = time.perf_counter()
            for step, is_save, t0, blocks, rids in self._timing:
                if step <= done_through:
                    (self._save_s if is_save else self._load_s).append(now - t0)
                    if not rids & failed:
                        self._done("save" if is_save else "load", now - t0, blocks)
            self._timing = [t for t in self._timing if t[0] > done_through]
        for step in [s for s in self._saving if s <= done_through]:
            del self._saving[step]
        out = CopyTimes(tuple(self._save_s[-MAX_COPY_TIMES:]), tuple(self._load_s[-MAX_COPY_TIMES:]),
                        self._load_failures)
        self._save_s, self._load_s, self._load_failures = [], [], 0
        return out

    def take_stats(self) -> dict[str, float | list[float]]:
        saving = len(set().union(*self._saving.values())) if self._saving else 0
        if saving != self._saving_reported:  # a gauge: sent when it changed, 0 included
            self.stats["pending_save_requests"] = saving
            self._saving_reported = saving
        out, self.stats = self.stats, {}
        return out

    def _count(self, key: str, v: float) -> None:
        n = self.stats.get(key, 0.0)
        assert not isinstance(n, list)
        self.stats[key] = n + v

    def _done(self, op: str, seconds: float, blocks: int) -> None:
        """A load or save batch of this rank whose copy completed: the original's per-operation
        series (``vllm:pega_{op}_duration_seconds``, ``_blocks``, ``_success_total``)."""
        for key, v in ((f"{op}_duration", seconds), (f"{op}_blocks", float(blocks))):
            seen = self.stats.setdefault(key, [])
            assert isinstance(seen, list)
            seen.append(v)
        self._count(f"{op}_success", 1)

    def close(self) -> None:
        self.inflight.drain()  # no copy may outlive the mapping it reads or writes
        for copier in (self.copier, self.state_copier):
            if copier is not None:
                copier.close()
        cuda = sys.modules.get("pegaflow.client.cuda")  # imported by a copy on CUDA, only then
        if cuda is not None:
            cuda.unregister_all()  # before the pool is unmapped
        if self.link is not None:
            self.link.close()
