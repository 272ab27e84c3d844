"""The core: what a block is and how a pool indexes it. No I/O, no other pegaflow package.

- :mod:`identity`: the namespace and block-hash functions (``HASH_BYTES``, ``KVIdentity``,
  ``block_hashes``, ``namespace_salt``, ``block_key``).
- :mod:`block_index` + :mod:`allocator`: the node's block index over one pool's pages.
- :mod:`trace`: the request-trace formats (``pegaflow`` query trace, Mooncake).
- :mod:`units`, :mod:`durations`: sizes and durations as users write them.
- :mod:`recent`: a bounded set of recently seen keys.
- :mod:`tiers`: the tiers' names (``Tier``: l1, ssd, remote) and the outcomes (``miss``).
- :mod:`hosts`: the one ``HOST:PORT`` rule and the address a node advertises to its peers.
- :mod:`router_protocol`: what the router and the connector say in vLLM's ``kv_transfer_params``.

What a pool decides to keep (admission, the hit-rate ceiling) is :mod:`pegaflow.policy`, one
layer up. Everything else in PegaFlow may import this package; it imports nothing of PegaFlow's
(enforced by the import-linter contracts in ``pyproject.toml``).
"""
