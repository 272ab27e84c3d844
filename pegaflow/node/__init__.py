"""``pegaflow-node``: the per-host daemon that owns the shared-memory pool, its SSD and peer
tiers, and the services engines call. ``daemon.py`` is the composition root (docs/architecture.md)."""
