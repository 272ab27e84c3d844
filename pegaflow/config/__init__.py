"""Configuration: the one option table (:mod:`options`) and the typed config it produces per
command (:mod:`commands`: ``NodeConfig``, ``MetaConfig``, ``ReplayConfig``, ``RouterConfig``,
``StatusConfig``, ``CacheConfig``); :mod:`tiers` carves the SSD and peer tiers' fields
out of ``NodeConfig``, :mod:`capacity` parses replay's capacities, sweeps and routing rules. Nothing below
the command-line entry points sees argparse."""
