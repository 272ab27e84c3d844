"""Every Redis key the metaserver and the node publisher use, in one place.

Two kinds of slots (Redis Cluster hash tags):

- ``{pf}``: the registry — node incarnations, liveness keys, stream leases, retired nids.
  Small; one slot, so the registry scripts and the liveness ``MGET`` are single-slot.
- ``{<ns tag>}``: the index of one namespace — 65536 bucket hashes plus an anchor key.
  A QueryPrefix touches one namespace, so its Lua script runs in one slot. The price:
  one namespace lives on one cluster shard (namespaces, not blocks, spread the load).

Block ``h`` (``HASH_BYTES`` = 16 bytes) of namespace tag ``t`` is field
``h[BUCKET_BYTES:]`` of hash ``pf:b:{t}`` + ``h[:BUCKET_BYTES]`` (:func:`bucket_key`,
:func:`field`); the value is the list of nids holding it, ``NID_BYTES`` = 4 each
(big-endian), the top bit (``TIER_BIT``) set when that holder has the block only on its SSD
tier. The index's Lua scripts and its packed batches are built from these
constants (``pegaflow/meta/index.py``), so this is the one place the split is defined. With <= 128 fields per bucket Redis keeps the bucket as a listpack,
about 30 bytes per block instead of ~110 for one key per block.
"""

from __future__ import annotations

import functools
import hashlib

from pegaflow.core.identity import HASH_BYTES

NODES = "pf:{pf}:nodes"  # HASH node name -> json {nid, epoch, addr, ttl[, prev]} of its newest incarnation
NEXT_NID = "pf:{pf}:nid"  # STRING counter; nids are never reused
VERSION = "pf:{pf}:ver"  # STRING counter bumped whenever the visible set of incarnations changes
SEEN = "pf:{pf}:seen"  # HASH node name -> ms (Redis clock) of its last registration or heartbeat
RETIRED = "pf:{pf}:retired"  # ZSET nid -> ms when retired; the sweeper removes their entries
NAMESPACES = "pf:{pf}:ns"  # HASH ns tag -> namespace string
CONSUMERS = "pf:{pf}:consumers"  # ZSET consumer name -> heartbeat deadline ms
SWEEP_LOCK = "pf:{pf}:sweep"
CLEANUP_LOCK = "pf:{pf}:cleanup"  # held by the operator's manual cleanup (pegaflow/meta/cleanup.py)
SWEPT = "pf:{pf}:swept"  # SET of retired nids already swept once
PAUSE = "pf:{pf}:pause"  # set by `pegaflow-meta rebuild`: replicas stop applying
VIEW_WATCH = "pf:{pf}:watch"  # never written: a replica's view BLPOPs it to see Redis go away at once
# Replacement classes by owner count (pegaflow/meta/owners.py, docs/architecture.md "Replacement classes"):
OWNER_COUNT = "pf:{pf}:owners"  # STRING the replicas' --min-reclaimable-owner-count (absent: no notices)
UNCOUNTED = "pf:{pf}:uncounted"  # SET of nids whose holder entries count as no owner (retired, not visible)
RECOUNTED = "pf:{pf}:recounted"  # SET: the uncounted set the notices were last brought up to
RECOUNT_LOCK = "pf:{pf}:recount"
# The decode backup (pegaflow/cluster/backup.py, docs/architecture.md "Decode backup"):
BACKUP_REPORTS = "pf:{pf}:bk:rep"  # HASH node -> "<has engine 0|1>:<since ms>:<pull max bytes>"
BACKUP_TARGETS = "pf:{pf}:bk:targets"  # SET of the nodes the planner treats as backup targets (expires)
BACKUP_LOCK = "pf:{pf}:bk:lock"  # held by the replica that plans

STREAM_PREFIX = "pf:ev:"  # + {<node>}: one event stream per node (pegaflow/meta/events/)

BUCKET_PREFIX = "pf:b:"  # live index
REBUILD_PREFIX = "pf:t:"  # index being rebuilt, renamed over the live one bucket by bucket
BUCKET_BYTES = 2  # leading bytes of a block hash that name its bucket
FIELD_BYTES = HASH_BYTES - BUCKET_BYTES  # the rest: its field in the bucket
BUCKETS = 1 << (8 * BUCKET_BYTES)
NID_BYTES = 4  # one holder in a block's holder list (big-endian nid)
TIER_BIT = 1 << (8 * NID_BYTES - 1)  # set in a holder entry: that nid holds the block only on its SSD


def live_key(node: str) -> str:
    """STRING nid visible to readers for ``node``, with the node's liveness TTL."""
    return f"pf:{{pf}}:live:{node}"


def stream_key(node: str) -> str:
    """The node's event stream, in a slot of its own. Node names may not contain braces
    (they would break the hash tag)."""
    if not node or "{" in node or "}" in node:
        raise ValueError(f"invalid node name {node!r}")
    return f"{STREAM_PREFIX}{{{node}}}"


def backup_offer_key(node: str) -> str:
    """STRING the node's backup candidates (``pegaflow/cluster/backup.py``), with a TTL; in the
    slot of its event stream."""
    return f"pf:bo:{{{node}}}"


def backup_plan_key(node: str) -> str:
    """LIST of backup plans queued for ``node`` (a target), oldest first; in its stream's slot."""
    return f"pf:bp:{{{node}}}"


def owner_key(node: str) -> str:
    """STRING consumer that owns ``node``'s stream (a lease with a TTL)."""
    return f"pf:{{pf}}:own:{node}"


def sketch_key(node: str) -> str:
    """STRING the node's serialized hit-rate ceiling sketch, with a TTL (``sketches.py``);
    in the slot of the node's event stream."""
    return f"pf:sk:{{{node}}}"


@functools.lru_cache(maxsize=4096)
def ns_tag(namespace: str) -> str:
    """16 hex chars naming a namespace in keys (namespace strings are long)."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()


def anchor_key(tag: str) -> str:
    """A key in the namespace's slot; scripts name it so the cluster routes them there."""
    return f"pf:n:{{{tag}}}"


def bucket_prefix(tag: str, prefix: str = BUCKET_PREFIX) -> bytes:
    return f"{prefix}{{{tag}}}".encode()


def bucket_key(tag: str, h: bytes, prefix: str = BUCKET_PREFIX) -> bytes:
    return bucket_prefix(tag, prefix) + h[:BUCKET_BYTES]


def notice_prefix(tag: str) -> bytes:
    """The namespace's class-notice lists, one per holder nid: ``notice_prefix(tag) + b"<nid>"``
    (``pegaflow/cluster/notices.py``); in the namespace's slot, so the index's scripts write
    them in the same step as the change."""
    return f"pf:c:{{{tag}}}:".encode()


def notice_key(tag: str, nid: int) -> bytes:
    return notice_prefix(tag) + str(nid).encode()


def field(h: bytes) -> bytes:
    """Block ``h``'s field in its bucket."""
    return h[BUCKET_BYTES:]
