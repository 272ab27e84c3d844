"""L3 SSD tier: see :mod:`pegaflow.node.tiers.ssd.tier` for the path of a block through it."""

from pegaflow.node.tiers.ssd.files import SsdError
from pegaflow.node.tiers.ssd.tier import SsdTier, open_tier

__all__ = ["SsdError", "SsdTier", "open_tier"]
