"""The consumer group of the node event streams.

One stream per node (``pegaflow.cluster.keys.stream_key``: ``pf:ev:{<node>}``; the braces
are a Redis Cluster hash tag, so each node's stream lives in one slot, per-node order is
kept, and different nodes spread over the cluster). Every metaserver replica reads every
stream through this one group; the node creates it with its stream, so entries written
before any replica started are delivered too.
"""

from __future__ import annotations

GROUP = "pf-meta"  # the one consumer group all metaserver replicas share
