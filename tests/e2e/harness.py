"""What the e2e tests hold engines to. The processes themselves (nodes, engines, API servers)
are the harness's: tests/harness/."""

from __future__ import annotations

from typing import Any

from tests.harness.node import Node


def full_blocks_claimable(n_tokens: int, block_size: int) -> int:
    """Tokens a connector may claim for a prompt: full blocks, never the last prompt token."""
    return (n_tokens - 1) // block_size * block_size


def assert_recomputed_equal(warm: list[dict[str, Any]], cold: list[dict[str, Any]], tol: float) -> None:
    """A restarted engine's outputs (from loaded KV) against the same engine recomputing:
    identical greedy tokens, logprobs within ``tol`` (float16 noise of a prefix-hit path)."""
    assert [o["tokens"] for o in warm] == [o["tokens"] for o in cold]
    diff = max(abs(a - b) for w, c in zip(warm, cold, strict=True)
               for a, b in zip(w["logprobs"], c["logprobs"], strict=True))
    assert diff <= tol, diff


def corrupt_pool(node: Node) -> None:
    """Overwrite the node's whole pool with random bytes (negative controls: loaded KV is used)."""
    from pegaflow.client import PegaClient

    c = PegaClient(node.addr)
    try:
        c.register({"pegaflow-test-corrupter": 4096})
        c.pool.random_(0, 256)
    finally:
        c.close()
