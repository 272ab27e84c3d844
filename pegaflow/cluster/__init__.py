"""How ``pegaflow-node`` and ``pegaflow-meta`` meet in Redis.

- :mod:`keys`: every Redis key and hash tag (the registry's, the event streams', the
  index's buckets and how a block hash splits into bucket and field).
- :mod:`registry`: node incarnations (nid, epoch), liveness, retirement.
- :mod:`sketches`: the per-node hit-rate ceiling sketches and their cluster union.
- :mod:`redis_conn`: one way to connect to Redis or Redis Cluster, scripts, raw batches.
- :mod:`seeds`: ``--redis-url``'s seeds, parsed without importing redis-py.
- :mod:`notices`: the replacement-class notices the metaserver leaves each node.
- :mod:`backup`: what nodes and the planning metaserver leave each other for the decode backup.

The events nodes publish are the metaserver's contract, :mod:`pegaflow.meta.events`.
Imports :mod:`pegaflow.core` (the hash length) and :mod:`pegaflow.policy` (the ceiling the
sketches carry) only.
"""
