"""The cluster contract shared by ``pegaflow-node`` and ``pegaflow-meta``: how they meet in Redis.

- :mod:`keys`: every Redis key and hash tag; :mod:`streams`: the per-node event streams
  and the consumer group.
- :mod:`schema` + :mod:`codec`: the event a node publishes and its wire encoding.
- :mod:`registry`: node incarnations (nid, epoch), liveness, retirement.
- :mod:`sketches`: the per-node hit-rate ceiling sketches.
- :mod:`redis_conn`: one way to connect to Redis or Redis Cluster.
- :mod:`hosts`: the address a node advertises to its peers.

Imports only :mod:`pegaflow.core` (and ``pegaflow.common`` helpers); the node's publisher
(:mod:`pegaflow.node.publishing`) and the metaserver's ingest (:mod:`pegaflow.meta.ingest`)
are the two sides that use it.
"""
