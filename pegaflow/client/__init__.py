"""Engine-side client: register with a node, map its pool, move pages. See :mod:`.client`."""

from pegaflow.client.client import (
    BlockEvents,
    ClientClosed,
    CopyTimes,
    NodeError,
    NodeUnavailable,
    PegaClient,
    QueryResult,
    QueryStatus,
    Reservation,
    ResetResult,
)
from pegaflow.client.pages import load_pages, page_bytes, save_pages

__all__ = [
    "BlockEvents",
    "ClientClosed",
    "CopyTimes",
    "NodeError",
    "NodeUnavailable",
    "PegaClient",
    "QueryResult",
    "QueryStatus",
    "Reservation",
    "ResetResult",
    "load_pages",
    "page_bytes",
    "save_pages",
]
