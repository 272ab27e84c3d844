"""Configuration: the one option table (:mod:`options`) and the typed config it produces per
command (:mod:`commands`: ``NodeConfig``, ``MetaConfig``, ``ReplayConfig``). Nothing below
the command-line entry points sees argparse."""
