"""``--redis-url``'s seeds, parsed without importing redis-py.

A node that is given only ``--metaserver-addr`` learns the seeds from ``GetClusterConfig``
and one with neither never connects to Redis; importing redis-py (~90 ms of CPU at every
start, measured with ``python -X importtime``) waits until a node publishes.
"""

from __future__ import annotations

from collections.abc import Sequence


def seed_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """The Redis URLs named by ``urls`` (``--redis-url``'s seeds, or a comma-separated list of
    them, as ``GetClusterConfig`` carries them), in order, each once."""
    items = [urls] if isinstance(urls, str) else list(urls)
    return tuple(dict.fromkeys(u.strip() for item in items for u in item.split(",") if u.strip()))
