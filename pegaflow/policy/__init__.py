"""What a pool decides to keep, and how good that can be.

- :mod:`.tinylfu`: TinyLFU admission in front of the LRU (``--enable-lfu-admission``).
- :mod:`.quota`: per-namespace shares of the L1 pool (``--namespace-quota``), which the
  block index's eviction applies.
- :mod:`.ceiling`: the hit-rate ceiling r* = (N - U) / N over rolling windows, from
  HyperLogLog sketches.

Pure rules with no I/O, used alike by the node and by ``pegaflow replay`` (one code, so a
replay predicts what the node does). They import only :mod:`pegaflow.core`.
"""
