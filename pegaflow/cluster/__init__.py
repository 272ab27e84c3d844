"""How ``pegaflow-node`` and ``pegaflow-meta`` meet in Redis.

- :mod:`keys`: every Redis key and hash tag (the registry's, the event streams', the
  index's buckets and how a block hash splits into bucket and field).
- :mod:`registry`: node incarnations (nid, epoch), liveness, retirement.
- :mod:`sketches`: the per-node hit-rate ceiling sketches and their cluster union.
- :mod:`redis_conn`: one way to connect to Redis or Redis Cluster, scripts, raw batches.
- :mod:`seeds`: ``--redis-url``'s seeds, parsed without importing redis-py.

The events nodes publish are the metaserver's contract, :mod:`pegaflow.meta.events`.
Imports :mod:`pegaflow.policy` only (the ceiling the sketches carry).
"""
