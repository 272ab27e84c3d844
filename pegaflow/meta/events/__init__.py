"""The event contract between node daemons and the metaserver.

A node tells the global index what it holds by appending events to its own Redis Stream;
any number of metaserver replicas consume them. This package is that contract, and the
only part of :mod:`pegaflow.meta` a node imports (an import-linter contract in
``pyproject.toml`` holds both directions: it imports nothing else of ``pegaflow.meta``):

- :mod:`.schema`: the event (``Event``, ``Op``) and the index update it becomes (``Update``).
- :mod:`.codec`: the event's binary encoding in one stream entry field.
- :mod:`.streams`: the consumer group every replica shares (stream keys are in
  ``pegaflow.cluster.keys`` with every other Redis key).
- :mod:`.consumer`: the metaserver side, reading every node's stream in order and handing
  updates to an ``IndexWriter``.

The node's side, which turns its block index's inserts and evictions into events, is
``pegaflow.node.publishing``.

Importing this package loads nothing: import the module you need.
"""
