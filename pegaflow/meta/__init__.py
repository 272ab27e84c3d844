"""``pegaflow-meta``: the global prefix index in Redis and its gRPC service (docs/meta.md).

:mod:`pegaflow.meta.events` is the event contract nodes share with it; this package's
``__init__`` imports nothing, so a node importing the contract loads nothing else of it.
"""
