"""Stream names and the consumer group.

One stream per node, ``pf:ev:{<node>}``: the braces are a Redis Cluster hash tag, so each
node's stream lives in one slot (per-node order is kept) and different nodes spread over
the cluster.
"""

from __future__ import annotations

GROUP = "pf-meta"  # the one consumer group all metaserver replicas share
STREAM_PREFIX = "pf:ev:"


def stream_key(node: str) -> str:
    """Stream of one node. Node names may not contain braces (they would break the hash tag)."""
    if not node or "{" in node or "}" in node:
        raise ValueError(f"invalid node name {node!r}")
    return f"{STREAM_PREFIX}{{{node}}}"

