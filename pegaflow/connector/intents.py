"""Messages between the scheduler-side and worker-side connector (frozen, picklable).

Every engine step the scheduler side sends one ``PegaConnectorMetadata`` to every worker
(TP ranks all receive the same object); every worker answers with one ``PegaWorkerReport``
that vLLM aggregates over ranks and hands back to the scheduler side.

Division of work: the scheduler side alone talks to the nodes (Query, Reserve, Commit,
Release); workers only copy between their paged KV cache and pool pages. So a worker never
blocks on the network, and a lease or reservation belongs to one session (the scheduler's
on the node that issued it).

Pages are named per **place** (``pegaflow.connector.placement``): one KV shard on one node.
With one node the places are the shards (place ``i`` is shard ``i``); with TP ranks on
several nodes (``pegaflow.tp_shard_endpoints``) each rank copies its own place only.

Contracts:

* A ``LoadIntent`` names pages the scheduler holds a lease on; the lease is released only
  after the step's report came back, so the pages cannot change under the copy.
* A ``ShardSave`` names reserved pages: invisible to readers until the scheduler commits
  them, which it does only after the report for that step arrived without the reservation
  in ``failed_reservations``. A worker that could not copy reports the reservation; the
  scheduler aborts it. Nothing half-written ever becomes visible.
* An asynchronous ``LoadIntent`` (``is_async``) may arrive in any later step, whether or
  not its request is scheduled; the worker reports it finished after copying it (or after
  failing to: its blocks are then load errors), never before.
* ``block_ids[i]`` is the engine block of page ``i``: an ``int``, or with several KV cache
  groups (vLLM's hybrid allocator) a tuple of one block id per group, where ``-1`` means
  the group holds no block there (a sliding-window layer outside the window: a load skips
  that part of the page; saves never carry ``-1``). With several groups vLLM cannot map a
  block id back to a request, so every load is asynchronous and a failed one fails the
  whole request (``failed_recving``): vLLM recomputes it.
* ``epochs[place]`` of a load, ``epoch`` of a shard save: the epoch of the place's node its
  offsets were issued under (each node has its own). A worker whose mapping of its own node
  is of another epoch (node restarted, worker not yet re-attached) must not copy: offsets
  would point into the wrong pool. It reports loads as failed (vLLM recomputes) and saves
  as failed. An epoch of ``-1`` matches no pool: its blocks are load errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from pegaflow.client.client import NO_COPIES, CopyTimes
from pegaflow.connector.vllm_compat import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

PageBlock: TypeAlias = int | tuple[int, ...]  # one block id, or one per KV cache group


@dataclass(frozen=True)
class LoadIntent:
    """Copy pool pages into engine blocks before this step's forward.

    ``offsets[place][i]`` is the page of ``block_ids[i]`` in place ``place`` (one KV shard on
    one node), issued under its node's epoch ``epochs[place]``.
    """

    req_id: str
    block_ids: tuple[PageBlock, ...]
    offsets: tuple[tuple[int, ...], ...]
    epochs: tuple[int, ...]
    # An asynchronous load (vLLM's ``(n, True)``): once copied, the worker reports ``req_id``
    # in ``get_finished``'s finished_recving; ``missing`` are blocks of it the node could not
    # deliver, reported as load errors (vLLM recomputes from the first of them).
    is_async: bool = False
    missing: tuple[PageBlock, ...] = ()
    # A state page (hybrid state-space models): ``block_ids`` are the state-space groups'
    # blocks, ``offsets`` pages of the state namespaces. It travels with its request's
    # attention load in the same step (both ``is_async``); either failing fails the request.
    state: bool = False


@dataclass(frozen=True)
class ShardSave:
    """Copy engine blocks of one KV shard into reserved pages of one place after this step's
    forward (the place's writing rank does: ``Placement.writes``)."""

    place: int
    reservation_id: int
    block_ids: tuple[PageBlock, ...]
    offsets: tuple[int, ...]
    epoch: int
    state: bool = False  # state pages (state-space groups' blocks) into the shard's state namespace


@dataclass(frozen=True)
class SaveIntent:
    """Newly computed full blocks of one request, one ``ShardSave`` per place that writes."""

    req_id: str
    shards: tuple[ShardSave, ...]


@dataclass(frozen=True)
class PegaConnectorMetadata(KVConnectorMetadata):
    """Everything the workers do for PegaFlow in one engine step."""

    step: int
    loads: tuple[LoadIntent, ...] = ()
    saves: tuple[SaveIntent, ...] = ()
    # Nothing is scheduled this step while copies are in flight (the engine going idle): the
    # workers wait for them on the host before they report, so the scheduler settles every
    # step now. vLLM runs one such step after the last request and then none until the next.
    flush: bool = False


@dataclass(frozen=True)
class PegaWorkerReport(KVConnectorWorkerMetadata):
    """What the workers did with the steps' metadata (merged over TP ranks).

    ``done_through``: every copy of this step and of every earlier one has completed (on a
    GPU copies run beside the forward and finish later; ``inflight.py``); over ranks, the
    smallest. ``lost_steps``: steps a rank never received (their copies were never made).
    ``failed_reservations``: saves a rank could not make. ``disabled``: a rank copies
    nothing (``WorkerSide.disable``): the scheduler stops planning copies. ``copies``: what
    the ranks' copies that completed since their last report took (every rank's, joined);
    the scheduler side sends them to the node with its next Commit or Release."""

    done_through: int = -1
    failed_reservations: frozenset[int] = frozenset()
    lost_steps: frozenset[int] = frozenset()
    disabled: bool = False
    copies: CopyTimes = NO_COPIES

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PegaWorkerReport:
        assert isinstance(other, PegaWorkerReport)
        return PegaWorkerReport(
            done_through=min(self.done_through, other.done_through),
            failed_reservations=self.failed_reservations | other.failed_reservations,
            lost_steps=self.lost_steps | other.lost_steps,
            disabled=self.disabled or other.disabled,
            copies=self.copies.merge(other.copies),
        )


@dataclass(frozen=True)
class PegaWorkerState(KVConnectorHandshakeMetadata):
    """One rank's state once its KV cache is registered, sent to the scheduler side before
    any request is scheduled (vLLM's handshake metadata): ``disabled`` says why the rank
    will copy nothing ("" if it copies); ``node`` is the id of the node it registered with
    ("" if none answered yet)."""

    rank: int
    disabled: str = ""
    node: str = ""
