"""The tiers a block is served from: one name each, in the code, the metrics, the wire and the docs.

- ``l1``: the node's own shared-memory pool (DRAM), the pages engines map and copy.
- ``ssd``: the node's own SSD tier (``--ssd-cache-path``); a hit there is promoted into L1.
- ``remote``: another node's pool or SSD, pulled into this node's L1 (``pegaflow.node.tiers.remote``).

A requested block that no tier served is a ``miss`` (the engine computes it): the tiers and
``miss`` are the *outcomes* that partition each request's blocks
(``pegaflow_node_request_blocks_total{outcome}``, the Stats RPC's ``TierBlocks``).

"Peer" names the other node, never a tier: the ``PegaPeer`` service, the peer data plane,
the ``pegaflow_node_p2p_*`` metrics. Names that others fix are mapped from these where they
are used, each with its source: the Rust original's metric labels (``ram``, ``rdma``:
``pegaflow/node/metrics.py``), vLLM's ``CacheHitSource`` (``host``, ``disk``, ``p2p``:
``pegaflow/connector/scheduler.py``), the wire's enums (node.proto's ``LoadingFrom``,
meta.proto's ``Tier``: the client and the metaserver's service). Prometheus label values,
``pegaflow status --json`` keys and the proto's field names are these values themselves,
except where the wire names the medium rather than the tier: node.proto's ``Medium``
(``MEDIUM_DRAM``: ``BlockEvents.medium`` is ``"dram"`` or ``"ssd"``) and ``CacheInspect``'s
``dram`` / ``dram_prefix`` fields (``pegaflow cache``), kept as released.
"""

from __future__ import annotations

import enum
from typing import Final


class Tier(enum.StrEnum):
    """Where a block is (or was found): its value is its name everywhere (a label, a JSON key)."""

    L1 = "l1"
    SSD = "ssd"
    REMOTE = "remote"


LOCAL_TIERS: Final[tuple[Tier, ...]] = (Tier.L1, Tier.SSD)
"""A node's own tiers: where a holder keeps a block (the global index records one per holder)."""

MISS: Final = "miss"
"""The outcome of a requested block that no tier served."""

OUTCOMES: Final[tuple[str, ...]] = (*Tier, MISS)
"""Where each requested block came from: a tier or ``miss`` (they partition a request's blocks)."""
