"""L3 SSD tier: see :mod:`pegaflow.node.tiers.ssd.tier` for the path of a block through it."""

from pegaflow.node.tiers.ssd.files import SsdError
from pegaflow.node.tiers.ssd.metrics import SsdStats
from pegaflow.node.tiers.ssd.tier import SsdFiles, SsdTier, open_cache

__all__ = ["SsdError", "SsdFiles", "SsdStats", "SsdTier", "open_cache"]
