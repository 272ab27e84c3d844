"""Each tier's own configuration, carved from :class:`NodeConfig` (the option table's NODE rows).

A tier reads only its fields, so it cannot depend on an option it does not name, and its
tests build it without the other fifty. The fields are not restated options: each is a
field of ``NodeConfig`` with the same name and type (``tests/unit/test_config_tiers.py``
fails otherwise), and :meth:`from_node` copies them by name.

    ssd = SsdConfig.from_node(config)    # pegaflow/node/tiers/ssd/
    peers = PeerConfig.from_node(config)  # pegaflow/node/tiers/remote/
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pegaflow.config.commands import NodeConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


# Any: keyword arguments for ``cls``, each the value of a NodeConfig field of the same name and
# type (tests/unit/test_config_tiers.py holds the types equal; mypy cannot see it by name).
def _named(cls: type[DataclassInstance], config: NodeConfig) -> dict[str, Any]:
    """The values of ``config``'s fields that the dataclass ``cls`` names."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}


@dataclass(frozen=True, slots=True)
class SsdConfig:
    """The SSD tier's options (``--ssd-*``, ``--max-prefetch-blocks``); docs/options.md says each."""

    ssd_cache_path: tuple[str, ...]  # empty: no SSD tier
    ssd_cache_capacity: int
    ssd_cache_shards: int
    ssd_io_engine: str
    ssd_queue_depth: int
    ssd_write_queue_size: int
    ssd_write_queue_depth: int
    ssd_write_inflight: int
    ssd_prefetch_queue_depth: int
    ssd_prefetch_inflight: int
    max_prefetch_blocks: int

    @classmethod
    def from_node(cls, config: NodeConfig) -> SsdConfig:
        return cls(**_named(cls, config))


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Remote reads' options: where the node serves pins and pages, and how it pulls."""

    addr: str  # the gRPC address (PegaPeer shares its port)
    advertise_addr: str
    transfer_addr: str
    metaserver_addr: str  # empty: serve peers, pull nothing
    nics: tuple[str, ...]  # empty: the TCP data plane
    qps_per_peer: int
    pin_ttl: float
    peer_backoff: float
    max_batch: int

    @classmethod
    def from_node(cls, config: NodeConfig) -> PeerConfig:
        return cls(**_named(cls, config))
