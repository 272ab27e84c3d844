"""The tiers' configs (pegaflow/config/tiers.py) are carved from the option table, not restated:
every field is a ``NodeConfig`` field of the same name and type, and ``from_node`` copies it."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from pegaflow.config.commands import NodeConfig, node_config
from pegaflow.config.tiers import PeerConfig, SsdConfig

TIER_CONFIGS = (SsdConfig, PeerConfig)


@pytest.mark.parametrize("cls", TIER_CONFIGS, ids=lambda c: c.__name__)
def test_every_field_of_a_tier_config_is_a_node_config_field_of_the_same_type(cls: type[SsdConfig] | type[PeerConfig]) -> None:
    node = typing.get_type_hints(NodeConfig)
    mine = typing.get_type_hints(cls)
    assert mine, f"{cls.__name__} names no field"
    for name, hint in mine.items():
        assert name in node, f"{cls.__name__}.{name} is not an option of pegaflow-node (NodeConfig)"
        assert hint == node[name], f"{cls.__name__}.{name} is {hint}, NodeConfig.{name} is {node[name]}"


@pytest.mark.parametrize("cls", TIER_CONFIGS, ids=lambda c: c.__name__)
def test_from_node_copies_each_field_by_name(cls: type[SsdConfig] | type[PeerConfig]) -> None:
    config = node_config(ssd_cache_path=("/a", "/b"), ssd_cache_capacity=3 << 30, ssd_io_engine="uring",
                         max_prefetch_blocks=7, addr="10.0.0.1:50055", advertise_addr="10.0.0.2:50055",
                         metaserver_addr="10.0.0.3:50056", nics=("mlx5_0",), pin_ttl=12.5, max_batch=99)
    carved = cls.from_node(config)
    assert type(carved).__dataclass_params__.frozen
    for f in dataclasses.fields(carved):
        assert getattr(carved, f.name) == getattr(config, f.name)
