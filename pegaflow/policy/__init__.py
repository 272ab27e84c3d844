"""What a pool decides to keep, and how good that can be.

- :mod:`.tinylfu`: TinyLFU admission in front of the LRU (``--enable-lfu-admission``).
- :mod:`.quota`: per-namespace shares of the L1 pool (``--namespace-quota``), which the
  block index's eviction applies.
- :mod:`.ceiling`: the hit-rate ceiling r* = (N - U) / N over rolling windows, from
  HyperLogLog sketches.
- :mod:`.classes`: the replacement classes' rule (when a block's holders are told to demote
  or restore it), which the metaserver's scripts mirror.
- :mod:`.backup`: which blocks a busy node offers for the decode backup.
- :mod:`.routing`: the kv-aware routing decision, one code for the router and replay.

Pure rules with no I/O, used alike by the node and by ``pegaflow replay`` (one code, so a
replay predicts what the node does). They import only :mod:`pegaflow.core`.
"""
