"""What the router and the connector say to each other through vLLM's ``kv_transfer_params``.

vLLM hands a request's ``kv_transfer_params`` to the connector, and returns what the
connector's ``request_finished`` answers in the response's ``kv_transfer_params``
(non-streamed responses). PegaFlow's part is the dict under ``ROUTER_KEY``:

request, from the router                 | answer, from the connector
-----------------------------------------|------------------------------------------------
``{"describe": true}`` (a 1-token probe) | the description below
``{"prefill": true}`` (P/D, prefill half) | the description, with ``stored_blocks``
``{"expect_blocks": n}`` (decode half)    | (the decode waits, bounded, for ``n`` blocks)

The description: ``version`` (``DESCRIBE_VERSION``), ``node`` (the node's id, as the
metaserver names it), ``node_addr``, ``root`` (the namespace root that seeds the block
hashes), ``namespaces`` (one per KV shard), ``page_bytes``, ``block_size``, ``mode``,
``prompt_blocks`` (the request's full prompt blocks) and ``stored_blocks`` (of those, the
ones the engine stored or found stored).
"""

ROUTER_KEY = "pegaflow"
DESCRIBE_VERSION = 1  # bumped when a field above changes meaning
